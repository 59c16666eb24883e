"""Claude Code's Messages shapes through the app with a fake engine (falcon.testing).

Documents (text, content, base64 PDF) and search results become text; images inside a
tool_result reach the model in a user turn right after the tool results; replayed hosted-tool
blocks, betas and the fields Claude Code 2.1 sends are accepted, never a 400.
"""

from __future__ import annotations

import base64
from typing import Any

from tests.helpers import pdf, png
from tests.unit.fake_engine import FakeEngine, client_for

B64 = lambda data: base64.b64encode(data).decode()  # noqa: E731


def post(engine: FakeEngine, messages: list[dict[str, Any]], **extra: Any):
    return client_for(engine).simulate_post("/v1/messages", params={"beta": "true"}, headers={
        "anthropic-beta": "mid-conversation-system-2026-04-07,some-future-beta-2099-01-01"},
        json={"model": "claude-opus-5-5", "max_tokens": 64, "messages": messages, **extra})


def read_turns(result_content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Read them"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}},
                {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"file_path": "b.pdf"}}]},
            {"role": "user", "content": result_content}]


def test_pdf_and_text_documents_become_text() -> None:
    engine = FakeEngine()
    result = post(engine, [{"role": "user", "content": [
        {"type": "document", "title": "Report", "source": {"type": "base64", "media_type": "application/pdf",
                                                           "data": B64(pdf("Revenue grew nine percent"))}},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain notes"},
         "context": "from the wiki", "citations": {"enabled": True}, "cache_control": {"type": "ephemeral"}},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "block text"}]}},
        {"type": "text", "text": "Summarise."}]}])
    assert result.status_code == 200, result.text
    text = engine.added[-1]["messages"][-1]["content"]
    assert "[Document: Report]" in text and "Revenue grew nine percent" in text
    assert "from the wiki\nplain notes" in text and "block text" in text and text.endswith("Summarise.")


def test_images_and_pdfs_in_tool_results_reach_the_model() -> None:
    engine = FakeEngine()
    result = post(engine, read_turns([
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64(png(1, 32))}}]},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [
            {"type": "text", "text": "PDF file read: b.pdf"},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                            "data": B64(pdf("Invoice total 42"))}}]},
        {"type": "text", "text": "What do they show?"}]))
    assert result.status_code == 200, result.text
    sent = engine.added[-1]
    roles = [m["role"] for m in sent["messages"]]
    assert roles == ["user", "assistant", "tool", "tool", "user"]  # the image follows the run of results
    first, second, after = sent["messages"][2:]
    assert "shown in the next user turn" in first["content"] and "Invoice total 42" in second["content"]
    assert "toolu_1" in after["content"] and after["content"].endswith("What do they show?")
    assert len(sent["media"]) == 1  # the image travels as media, like any user image


def test_fields_and_replayed_blocks_claude_code_sends_are_accepted() -> None:
    engine = FakeEngine()
    messages = [
        {"role": "user", "content": "search it"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "text", "text": "Found it."}]},
        {"role": "system", "content": [{"type": "text", "text": "Agents: none",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": []},
        {"role": "user", "content": [{"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}}]}]
    result = post(engine, messages, thinking={"type": "adaptive", "display": "omitted"},
                  context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                  output_config={"effort": "medium"}, metadata={"user_id": "u"},
                  system=[{"type": "text", "text": "You are Claude Code", "cache_control": {"type": "ephemeral"}}])
    assert result.status_code == 200, result.text
    sent = engine.added[-1]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "system", "user"]


def test_a_broken_pdf_or_a_url_document_is_a_clear_400() -> None:
    engine = FakeEngine()
    broken = post(engine, [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": B64(b"%PDF-")}}]}])
    assert broken.status_code == 400 and broken.json["type"] == "error"
    assert "could not be read" in broken.json["error"]["message"]
    url = post(engine, [{"role": "user", "content": [
        {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}}]}])
    assert url.status_code == 400 and "not fetched" in url.json["error"]["message"]


def search_result(title: str, source: str, *texts: str, **extra: Any) -> dict[str, Any]:
    return {"type": "search_result", "source": source, "title": title,
            "content": [{"type": "text", "text": text} for text in texts], **extra}


def test_search_results_reach_the_model_as_text_in_place() -> None:
    """`search_result` blocks were dropped silently: the model never saw what the client's search found."""
    engine = FakeEngine()
    result = post(engine, [{"role": "user", "content": [
        {"type": "text", "text": "Using these results:"},
        search_result("Fox habitats", "https://example.com/foxes", "Foxes live in dens.", "They hunt at night.",
                      citations={"enabled": True}, cache_control={"type": "ephemeral"}),
        {"type": "text", "text": "Where do foxes live?"}]}])
    assert result.status_code == 200, result.text
    assert engine.added[-1]["messages"][-1]["content"] == (
        "Using these results:\n[Search result: Fox habitats]\nSource: https://example.com/foxes\n"
        "Foxes live in dens.\nThey hunt at night.\nWhere do foxes live?")

    search = [{"role": "user", "content": "Search for otters"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search",
                                                 "input": {"q": "otters"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                  search_result("Otters", "kb://otters", "Otters hold hands while sleeping."),
                  search_result("Sea otters", "kb://sea-otters", "Sea otters use tools.")]}]}]
    result = post(engine, search)
    assert result.status_code == 200, result.text
    tool = engine.added[-1]["messages"][-1]
    assert tool["role"] == "tool" and tool["tool_call_id"] == "toolu_1"
    assert tool["content"] == ("[Search result: Otters]\nSource: kb://otters\nOtters hold hands while sleeping.\n"
                               "[Search result: Sea otters]\nSource: kb://sea-otters\nSea otters use tools.")


def test_a_malformed_search_result_is_a_400_naming_the_param() -> None:
    engine = FakeEngine()
    good = search_result("T", "S", "text")
    for broken, param in (({**good, "source": None}, "messages.0.content.0.source"),
                          ({**good, "title": 3}, "messages.0.content.0.title"),
                          ({key: value for key, value in good.items() if key != "content"},
                           "messages.0.content.0.content"),
                          ({**good, "content": "text"}, "messages.0.content.0.content"),
                          ({**good, "content": [{"type": "image", "source": {}}]}, "messages.0.content.0.content.0"),
                          ({**good, "citations": {"enabled": "yes"}}, "messages.0.content.0.citations")):
        result = post(engine, [{"role": "user", "content": [broken]}])
        assert result.status_code == 400 and result.json["type"] == "error", (broken, result.json)
        assert result.json["error"]["type"] == "invalid_request_error"
        assert result.json["error"]["message"].startswith(f"{param}:"), (param, result.json)
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]}
    inside = post(engine, [{"role": "user", "content": "q"}, call, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{**good, "title": None}]}]}])
    assert inside.status_code == 400
    assert inside.json["error"]["message"].startswith("messages.2.content.0.content.0.title:")
    assert not engine.added


def test_anthropic_hosted_tools_are_left_out_and_named() -> None:
    engine = FakeEngine()
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
             {"name": "Read", "description": "reads a file", "input_schema": {"type": "object", "properties": {}}}]
    result = post(engine, [{"role": "user", "content": "hi"}], tools=tools)
    assert result.status_code == 200, result.text
    assert [t["function"]["name"] for t in engine.added[-1]["tools"]] == ["Read"]
    assert result.headers["X-Ignored-Tools"] == "web_search"


def costly_pdf(pages: int = 50, stream_bytes: int = 1 << 20) -> bytes:
    """Pages sharing one content stream of empty text operators: ~10 KB that cost minutes of pypdf's time."""
    import zlib

    content = zlib.compress((b"BT /F1 12 Tf () Tj ET\n" * (stream_bytes // 22)), 9)
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (5 + i) for i in range(pages)) + b"] /Count %d >>"
               % pages,
               b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(content) + content + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R "
                b"/Resources << /Font << /F1 4 0 R >> >> >>"] * pages
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_a_pdf_that_would_cost_minutes_is_cut_off_at_its_deadline(monkeypatch) -> None:
    """Red team: 10.7 KB of PDF kept a worker thread busy for 108 s (hours with a few KB more), and a client
    that left did not stop it. Extraction runs in a child process killed at its deadline."""
    from http_frontend.parsing import pdf_text

    bomb = costly_pdf()
    assert len(bomb) < 20_000
    monkeypatch.setattr(pdf_text, "MAX_PDF_SECONDS", 1.5)
    response = post(FakeEngine(), [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": B64(bomb)}}]}])
    assert response.status_code == 400 and "within 1.5 s" in response.json["error"]["message"], response.json
    assert pdf_text.extract(pdf("Invoice total 42")).texts == ["Invoice total 42"]


def test_pdfs_waiting_behind_busy_readers_get_a_503_in_bounded_time(monkeypatch) -> None:
    """Re-verification: behind six hostile PDFs a normal one waited 59 s (2 readers a worker, no bound on the
    wait). A reader not free within the deadline is a 503 `pdf_reader_busy` with Retry-After."""
    from http_frontend.parsing import pdf_text

    monkeypatch.setattr(pdf_text, "MAX_PDF_SECONDS", 0.5)
    taken = [pdf_text._SLOTS.acquire(timeout=1) for _ in range(pdf_text.MAX_CONCURRENT)]
    try:
        response = post(FakeEngine(), [{"role": "user", "content": [{"type": "document", "source": {
            "type": "base64", "media_type": "application/pdf", "data": B64(pdf("Invoice total 42"))}}]}])
    finally:
        for _ in taken:
            pdf_text._SLOTS.release()
    assert response.status_code == 503 and response.headers["retry-after"] == "5", response.json
    assert response.json["error"]["type"] == "api_error" or response.json["type"] == "error"
