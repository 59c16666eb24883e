"""A tool call's arguments stream while the model writes them, and the whole call extends what streamed.

Fed as a model writes (a character at a time, and in larger pieces), every family's call
announces its id and name once the name is written, streams its arguments as they settle,
and closes with the same index and id and arguments that start with everything streamed:
a client that appends the pieces and the rest ends with the call's JSON.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm.tool_parsers import glm47, json_tools, qwen3_coder

from engine_daemon.output.call_text import settled_call
from engine_daemon.output.parser import OutputParser

QWEN = SimpleNamespace(think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                       tool_call_end="</tool_call>", tool_parser=json_tools.parse_tool_call)
CODER = SimpleNamespace(think_start=None, think_end=None, tool_call_start="<tool_call>",
                        tool_call_end="</tool_call>", tool_parser=qwen3_coder.parse_tool_call)
GLM = SimpleNamespace(think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                      tool_call_end="</tool_call>", tool_parser=glm47.parse_tool_call)
NO_PARSER = SimpleNamespace(think_start=None, think_end=None, tool_call_start=None, tool_call_end=None,
                            tool_parser=None)
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "mode": {"type": "integer"}}}}}]
CONTENT = "def f():\n    return {\"a\": [1, 2]}\n\n# café } ]\n"
EXPECTED = {"path": "src/a.py", "content": CONTENT, "mode": 644}


def stream(tokenizer: SimpleNamespace, text: str, size: int, cut: bool = False) -> tuple[list[dict], list[dict], str]:
    """(pieces of calls, whole calls, answer text) of `text` fed `size` characters at a time."""
    parser = OutputParser(tokenizer, in_thinking=False, tools=TOOLS)
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    pieces: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    answer = ""
    for number, chunk in enumerate(chunks):
        delta = parser.feed(chunk, final=number == len(chunks) - 1, cut=cut)
        for call in delta.tool_calls:  # a call closes: everything streamed of it is a prefix of its arguments
            sent = "".join(p["arguments"] for p in pieces if p["index"] == call["index"])
            assert call["arguments"].startswith(sent), (sent, call["arguments"])
        pieces += delta.tool_call_deltas
        calls += delta.tool_calls
        answer += delta.text
    return pieces, calls, answer


def streamed(pieces: list[dict], index: int) -> str:
    return "".join(p["arguments"] for p in pieces if p["index"] == index)


CALLS = {
    "json": (QWEN, '<tool_call>\n' + json.dumps({"name": "write_file", "arguments": EXPECTED}) + '\n</tool_call>'),
    "compact json": (QWEN, '<tool_call>{"name":"write_file","arguments":'
                     + json.dumps(EXPECTED, separators=(",", ":"), ensure_ascii=True) + '}</tool_call>'),
    "fallback json": (NO_PARSER, json.dumps({"name": "write_file", "parameters": EXPECTED})),
    "qwen3-coder": (CODER, "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
                    f"<parameter=content>\n{CONTENT}\n</parameter>\n<parameter=mode>\n644\n</parameter>\n"
                    "</function>\n</tool_call>"),
    "glm": (GLM, f"<tool_call>write_file<arg_key>path</arg_key><arg_value>src/a.py</arg_value><arg_key>content"
            f"</arg_key><arg_value>{CONTENT.strip()}</arg_value><arg_key>mode</arg_key><arg_value>644</arg_value>"
            "</tool_call>"),
}


@pytest.mark.parametrize("family", sorted(CALLS))
@pytest.mark.parametrize("size", [1, 3, 17])
def test_a_calls_arguments_stream_while_it_is_written(family: str, size: int) -> None:
    tokenizer, text = CALLS[family]
    pieces, calls, answer = stream(tokenizer, text, size)
    (call,) = calls
    expected = {**EXPECTED, "content": CONTENT.strip()} if family == "glm" else EXPECTED
    assert json.loads(call["arguments"]) == expected and "partial" not in call and answer == ""
    first = pieces[0]
    assert (first["index"], first["id"], first["name"]) == (call["index"], call["id"], "write_file")
    assert all("name" not in p for p in pieces[1:])
    sent = streamed(pieces, call["index"])
    assert len(sent) > len(call["arguments"]) // 2, (sent, call["arguments"])  # most of it before the call closed
    assert len([p for p in pieces if p["arguments"]]) > (1 if size == 17 else 5)


def test_streamed_arguments_are_what_was_written_when_the_canonical_form_differs() -> None:
    _, text = CALLS["compact json"]
    pieces, (call,), _ = stream(QWEN, text, 1)
    assert call["arguments"] == json.dumps(EXPECTED, separators=(",", ":"), ensure_ascii=True)
    assert call["arguments"].startswith(streamed(pieces, 0)) and "\\u00e9" in call["arguments"]


def test_two_calls_stream_under_their_own_index() -> None:
    one = json.dumps({"name": "write_file", "arguments": {"path": "a"}})
    two = json.dumps({"name": "write_file", "arguments": {"path": "b", "content": "x" * 40}})
    pieces, calls, answer = stream(QWEN, f"<tool_call>\n{one}\n</tool_call>\n<tool_call>\n{two}\n</tool_call>", 2)
    assert [c["index"] for c in calls] == [0, 1] and answer == ""
    assert [p["id"] for p in pieces if "id" in p] == [c["id"] for c in calls]
    for call in calls:
        assert call["arguments"].startswith(streamed(pieces, call["index"]))
    assert streamed(pieces, 1).startswith('{"path": "b", "content": "xxx')


def test_a_streamed_call_that_turns_out_malformed_stays_a_call() -> None:
    """Once announced, a call cannot become answer text: it ends as the call as written, marked partial."""
    text = '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "content": "x" oops}\n</tool_call>'
    pieces, (call,), answer = stream(QWEN, text, 4)
    assert answer == "" and call["partial"] is True and call["name"] == "write_file"
    assert call["arguments"].startswith(streamed(pieces, 0)) and streamed(pieces, 0).startswith('{"path": "a.py"')


def test_a_cut_call_streams_and_closes_partial() -> None:
    _, text = CALLS["qwen3-coder"]
    cut = text[:text.index("return") + 3]
    pieces, (call,), _ = stream(CODER, cut, 1, cut=True)
    assert call["partial"] is True and call["arguments"].startswith(streamed(pieces, 0))
    assert call["arguments"] == '{"path": "src/a.py", "content": "def f():\\n    ret'


def test_a_json_answer_that_names_no_tool_streams_no_call() -> None:
    pieces, _, _ = stream(NO_PARSER, json.dumps({"name": "someone", "arguments": {"age": 4}}), 1)
    assert not pieces


@pytest.mark.parametrize("family", sorted(CALLS))
def test_settled_arguments_only_grow(family: str) -> None:
    """Every reading of the call so far extends the one before: nothing streamed is ever taken back."""
    _, text = CALLS[family]
    before = ""
    for end in range(len(text)):
        start = text.find(">", text.find("<tool_call")) + 1 if text.startswith("<tool_call>") else 0
        settled = settled_call(text[start:end], TOOLS)
        if settled is not None:
            assert settled[1].startswith(before), (text[start:end], before, settled[1])
            before = settled[1]
    assert before


def test_a_value_that_is_not_a_string_streams_only_when_finished() -> None:
    _, text = CALLS["qwen3-coder"]
    upto = text.index("644") + 2  # "64": it may become 640
    name, arguments = settled_call(text[len("<tool_call>"):upto], TOOLS)
    assert arguments.endswith('"mode": ') and name == "write_file"


def test_text_after_a_streamed_call_in_the_same_update_comes_after_it() -> None:
    """A slow reader's update merges a call's last piece, its end and the text after it: the call ends first."""
    from http_frontend.anthropic.stream import BlockBuilder
    from http_frontend.engine.request_stream import RequestStream
    from http_frontend.openai.responses_stream import ResponseBuilder

    stream = RequestStream("f:1")
    first = {"rid": "f:1", "seq": 0, "text": "", "tool_call_deltas": [
        {"index": 0, "id": "call_1", "name": "write_file", "arguments": '{"path": "a'}]}
    rest = [{"rid": "f:1", "seq": 1, "text": "", "tool_call_deltas": [{"index": 0, "arguments": '.py"'}]},
            {"rid": "f:1", "seq": 2, "text": "", "tool_calls": [
                {"index": 0, "id": "call_1", "name": "write_file", "arguments": '{"path": "a.py"}'}]},
            {"rid": "f:1", "seq": 3, "text": "Done."}]
    stream.on_deltas(first)
    updates = [stream._pending]
    stream._pending = type(stream._pending)()
    for item in rest:
        stream.on_deltas(item)
    updates.append(stream._pending)

    blocks = BlockBuilder()
    events = [e for update in updates for e in blocks.feed(update)] + blocks.finish()
    assert blocks.blocks == [{"type": "tool_use", "id": "call_1", "name": "write_file", "input": {"path": "a.py"}},
                             {"type": "text", "text": "Done."}]
    assert "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                   and e["index"] == 0) == '{"path": "a.py"}'
    assert [e["type"] for e in events].count("content_block_stop") == 2

    builder = ResponseBuilder({"id": "resp_1", "model": "m"})
    events = [e for update in updates for e in builder.feed(update)]
    assert [item["type"] for item in builder.output] == ["function_call", "message"]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    assert builder.output[0]["arguments"] == '{"path": "a.py"}'
