"""Chats longer than the context window, end to end: refused, truncated, or summarised.

One engine (`--context-overflow truncate`) serves the tiny model under three aliases with a
256-token window (models-config `context_length`): `trunc` inherits the flag, `strict` says
`error`, `summ` says `summarize`. What the engine did is checked from outside: the
`X-Context-Overflow` header, `usage.context_overflow`, prompt sizes recounted with
/v1/tokenize, and the engine log.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, running_stack

WINDOW, MAX_TOKENS = 256, 16
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls count silver stars".split()


@pytest.fixture(scope="module")
def served(tiny_model: Path, ipc_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Frontend]]:
    base = tmp_path_factory.mktemp("overflow")
    entries = [("trunc", None), ("strict", "error"), ("summ", "summarize")]
    (base / "models.yaml").write_text("models:\n" + "".join(
        f"  - alias: {name}\n    path: {tiny_model}\n    context_length: {WINDOW}\n"
        + (f"    context_overflow: {mode}\n" if mode else "") for name, mode in entries))
    with running_stack(f"ipc://{ipc_dir}/overflow.sock", base,
                       engine_args=["--models-config", str(base / "models.yaml"),
                                    "--context-overflow", "truncate"]) as stack:
        yield stack


def conversation(turns: int, words: int = 4) -> list[dict[str, str]]:
    """A system message and `turns` user/assistant messages, ending with a user message."""
    messages = [{"role": "system", "content": "You answer briefly."}]
    for i in range(turns):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
        messages.append({"role": "user" if (turns - i) % 2 else "assistant", "content": f"{i}: {text}"})
    return messages


def chat(frontend: Frontend, model: str, messages: list[dict], **extra: object) -> httpx.Response:
    return httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra})


def prompt_tokens(frontend: Frontend, model: str, messages: list[dict]) -> int:
    """What the loaded model's template makes of `messages`, counted by the engine."""
    r = httpx.post(f"{frontend.base_url}/v1/tokenize", timeout=30, json={"model": model, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_error_mode_refuses_with_context_length_exceeded(served: tuple[Engine, Frontend]) -> None:
    _, frontend = served
    r = chat(frontend, "strict", conversation(30))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] in ("messages", "max_tokens")
    assert f"maximum context length is {WINDOW} tokens" in error["message"]
    assert "X-Context-Overflow" not in r.headers


def test_truncate_drops_the_fewest_oldest_turns(served: tuple[Engine, Frontend]) -> None:
    _, frontend = served
    messages = conversation(30)
    r = chat(frontend, "trunc", messages)
    assert r.status_code == 200, r.text
    assert r.headers["X-Context-Overflow"] == "truncated"
    usage = r.json()["usage"]
    dropped = usage["context_overflow"]["dropped_messages"]
    assert usage["context_overflow"]["mode"] == "truncated" and 0 < dropped < 30
    assert usage["prompt_tokens"] + MAX_TOKENS <= WINDOW
    assert prompt_tokens(frontend, "trunc", messages) + MAX_TOKENS > WINDOW  # it really did not fit
    # What was sent is the system message plus the newest turns, starting at a user turn...
    kept = messages[:1] + messages[1 + dropped:]
    assert kept[1]["role"] == "user" and prompt_tokens(frontend, "trunc", kept) == usage["prompt_tokens"]
    # ...and two fewer dropped (the previous cut that starts at a user turn) would not have fitted.
    assert prompt_tokens(frontend, "trunc", messages[:1] + messages[dropped - 1:]) + MAX_TOKENS > WINDOW

    # A chat that fits is left alone.
    r = chat(frontend, "trunc", conversation(3))
    assert r.status_code == 200 and "X-Context-Overflow" not in r.headers
    assert "context_overflow" not in r.json()["usage"]


def test_truncate_reports_on_streams_and_other_routes(served: tuple[Engine, Frontend]) -> None:
    _, frontend = served
    messages = conversation(30)
    with httpx.stream("POST", f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
            "model": "trunc", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["X-Context-Overflow"] == "truncated"
        body = r.read().decode()
    assert body.rstrip().endswith("data: [DONE]")
    r = httpx.post(f"{frontend.base_url}/v1/messages", timeout=60, json={
        "model": "trunc", "max_tokens": MAX_TOKENS, "system": "You answer briefly.",
        "messages": messages[2:]})  # Anthropic's messages start with a user turn
    assert r.status_code == 200, r.text
    assert r.headers["X-Context-Overflow"] == "truncated"


def test_truncate_cannot_help_a_single_huge_message_or_a_raw_prompt(served: tuple[Engine, Frontend]) -> None:
    _, frontend = served
    huge = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " ".join(WORDS * 30)}]
    r = chat(frontend, "trunc", huge)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(f"{frontend.base_url}/v1/completions", timeout=60, json={
        "model": "trunc", "prompt": " ".join(WORDS * 30), "max_tokens": MAX_TOKENS})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "prompt"


def test_summarize_keeps_system_and_last_six_and_summarises_the_rest(served: tuple[Engine, Frontend]) -> None:
    engine, frontend = served
    messages = conversation(30)
    r = chat(frontend, "summ", messages)
    assert r.status_code == 200, r.text
    assert r.headers["X-Context-Overflow"] == "summarized"
    usage = r.json()["usage"]
    assert usage["context_overflow"] == {"mode": "summarized", "dropped_messages": 30 - 6}
    assert usage["prompt_tokens"] + MAX_TOKENS <= WINDOW
    assert prompt_tokens(frontend, "summ", messages) > WINDOW
    # The kept turns are all there: the prompt is longer than system + last six alone (the summary note).
    assert usage["prompt_tokens"] > prompt_tokens(frontend, "summ", messages[:1] + messages[-6:])
    log = engine.log()
    assert "summarized 24 message(s)" in log and "context overflow (summarized): 24 message(s) dropped" in log
    # Greedy and bounded: the same request is summarised the same way.
    again = chat(frontend, "summ", messages)
    assert again.json()["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert again.json()["choices"][0]["message"]["content"] == r.json()["choices"][0]["message"]["content"]


def test_summarize_needs_older_turns(served: tuple[Engine, Frontend]) -> None:
    _, frontend = served
    few = [{"role": "system", "content": "Be brief."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(WORDS * 5)} for i in range(5)]
    r = chat(frontend, "summ", few)  # five long turns: nothing older than the last six to summarise
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"


def respond(frontend: Frontend, model: str, items: list[dict] | str, **extra: object) -> httpx.Response:
    return httpx.post(f"{frontend.base_url}/v1/responses", timeout=60, json={
        "model": model, "input": items, "max_output_tokens": MAX_TOKENS, "temperature": 0, **extra})


def test_responses_truncation_auto_drops_the_oldest_items_and_says_so(served: tuple[Engine, Frontend]) -> None:
    _, frontend = served
    items = conversation(30)
    # "auto" truncates even on a model set to refuse (`strict`): the client asked for it.
    r = respond(frontend, "strict", items, truncation="auto", max_tool_calls=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["X-Context-Overflow"] == "truncated" and 0 < body["usage"]["context_overflow"][
        "dropped_messages"] < 30
    assert body["usage"]["input_tokens"] + MAX_TOKENS <= WINDOW
    assert body["truncation"] == "auto" and body["max_tool_calls"] == 2
    assert prompt_tokens(frontend, "strict", items) + MAX_TOKENS > WINDOW  # it really did not fit
    # "disabled" refuses even on a model set to truncate, naming a Responses field.
    r = respond(frontend, "trunc", items, truncation="disabled")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] in ("input", "max_output_tokens")
    # Unset, the model's setting decides, and the echo says what was done.
    assert respond(frontend, "trunc", items).json()["truncation"] == "auto"
    assert respond(frontend, "trunc", "hi").json()["truncation"] == "disabled"
    assert respond(frontend, "trunc", "hi", truncation="middle").status_code == 400
    # An input whose bytes alone could never fit is truncated too, not refused by its size.
    huge = [{"role": "user", "content": "word " * 20000}, {"role": "assistant", "content": "ok"}, items[-1]]
    r = respond(frontend, "strict", huge, truncation="auto")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["context_overflow"]["dropped_messages"] == 2
    # What must stay (the last turn) could never fit: refused by its size, never rendered or tokenized.
    r = respond(frontend, "strict", [items[0], {"role": "user", "content": "word " * 20000}], truncation="auto")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "cannot fit" in r.json()["error"]["message"]
