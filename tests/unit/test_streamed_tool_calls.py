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

from engine_daemon.output.call_text import SettledReader
from engine_daemon.output.parser import OutputParser
from tests.unit.tokenizer_stubs import CODER, GLM, KIMI, MINIMAX, MISTRAL, NO_PARSER, QWEN

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
    "mistral": (MISTRAL, "[TOOL_CALLS]write_file[ARGS]" + json.dumps(EXPECTED)),
    "kimi": (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>"
             + json.dumps(EXPECTED) + "<|tool_call_end|><|tool_calls_section_end|>"),
    "minimax": (MINIMAX, '<minimax:tool_call>\n<invoke name="write_file">\n'
                '<parameter name="path">src/a.py</parameter>\n'
                f'<parameter name="content">{CONTENT}</parameter>\n<parameter name="mode">644</parameter>\n'
                "</invoke>\n</minimax:tool_call>"),
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
    expected = {**EXPECTED, "content": CONTENT.strip()} if family in ("glm", "minimax") else EXPECTED
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
    tokenizer, text = CALLS[family]
    reader = SettledReader(TOOLS, tokenizer.tool_parser)
    marker = tokenizer.tool_call_start or ""
    start = len(marker) if marker and text.startswith(marker) else 0
    before = ""
    for end in range(start, len(text)):
        settled = reader.read(text[start:end])
        if settled is not None:
            assert settled[1].startswith(before), (text[start:end], before, settled[1])
            before = settled[1]
    assert before


def test_a_value_that_is_not_a_string_streams_only_when_finished() -> None:
    tokenizer, text = CALLS["qwen3-coder"]
    upto = text.index("644") + 2  # "64": it may become 640
    name, arguments = SettledReader(TOOLS, tokenizer.tool_parser).read(text[len("<tool_call>"):upto])
    assert arguments.endswith('"mode": ') and name == "write_file"


def coder_call(key: str, value: str, newlines: bool = True) -> str:
    gap = "\n" if newlines else ""
    return f"<tool_call>\n<function=f>\n<parameter={key}>{gap}{value}{gap}</parameter>\n</function>\n</tool_call>"


def glm_call(key: str, value: str) -> str:
    return f"<tool_call>f<arg_key>{key}</arg_key><arg_value>{value}</arg_value></tool_call>"


# Red team: values mlx-lm's parsers convert (Qwen3-Coder's "null" for any type, `anyOf` kept as text, booleans,
# literal_eval; GLM's `_deserialize`) streamed as our own reading said, and the whole call disagreed.
CONVERTED = [(CODER, coder_call("path", "null"), {"path": {"type": "string"}}, {"path": None}),
             (CODER, coder_call("limit", "5"), {"limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
              {"limit": "5"}),
             (CODER, coder_call("flag", "True"), {"flag": {"type": "boolean"}}, {"flag": True}),
             (CODER, coder_call("n", "1.0"), {"n": {"type": "number"}}, {"n": 1}),
             (CODER, coder_call("path", "abc", newlines=False), {"path": {"type": "string"}}, {"path": "abc"}),
             (CODER, coder_call("other", "nullable"), {}, {"other": "nullable"}),
             (GLM, glm_call("n", "None"), {"n": {"type": "integer"}}, {"n": None}),
             (GLM, glm_call("s", "  padded  "), {"s": {"type": "string"}}, {"s": "padded"})]


@pytest.mark.parametrize("tokenizer,text,properties,expected", CONVERTED)
def test_streamed_values_are_what_the_family_parser_makes_of_them(tokenizer, text: str, properties: dict,
                                                                    expected: dict) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": properties}}}]
    for size in (1, 2, 5):
        parser = OutputParser(tokenizer, in_thinking=False, tools=tools)
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        deltas = [parser.feed(chunk, final=n == len(chunks) - 1) for n, chunk in enumerate(chunks)]
        pieces = [piece for delta in deltas for piece in delta.tool_call_deltas]
        (call,) = [call for delta in deltas for call in delta.tool_calls]
        assert call["arguments"].startswith(streamed(pieces, 0)) and "partial" not in call
        assert json.loads(call["arguments"]) == expected


def test_a_call_after_an_unreadable_block_streams_from_its_start() -> None:
    """Red team: a block returned as text left the parser's last reading length behind, and the next
    call streamed nothing until it was longer than that block."""
    bad = '<tool_call>\n{"arguments": {"content": "' + "x" * 5000 + '"}, "name": "write_file"} oops\n</tool_call>\n'
    good = '<tool_call>\n' + json.dumps({"name": "write_file", "arguments": {"path": "a", "content": "y" * 200}}) \
        + "\n</tool_call>"
    pieces, calls, _ = stream(QWEN, bad + good, 3)
    assert calls[-1]["name"] == "write_file" and len([p for p in pieces if p["arguments"]]) > 20


def test_an_escaped_name_streams_decoded() -> None:
    pieces, (call,), _ = stream(QWEN, '<tool_call>\n{"name": "write\\u005ffile", "arguments": {"path": "a"}}\n'
                                      '</tool_call>', 1)
    assert pieces[0]["name"] == call["name"] == "write_file"


def test_a_whole_object_followed_by_junk_is_the_call_without_the_junk() -> None:
    pieces, (call,), answer = stream(QWEN, '<tool_call>\n{"name": "write_file", "arguments": {"path": "a"}} junk\n'
                                           '</tool_call>', 1)
    assert call["arguments"] == '{"path": "a"}' and "partial" not in call and answer == ""
    assert call["arguments"].startswith(streamed(pieces, 0))


def test_a_fallback_call_ended_mid_json_is_the_same_call_however_it_was_fed() -> None:
    """Verification helper: fed whole, a JSON-fallback call that EOS ended after its name was answer text;
    fed as tokens it had been announced, so a (partial) call. Both are the partial call now."""
    text = '{"name":"write_file",\n '
    _, whole, answer_whole = stream(NO_PARSER, text, len(text))
    _, pieces, answer_pieces = stream(NO_PARSER, text, 1)
    assert [(c["name"], c.get("partial")) for c in whole] == [(c["name"], c.get("partial")) for c in pieces] \
        == [("write_file", True)]
    assert answer_whole == answer_pieces == ""


@pytest.mark.parametrize("family", ["json", "qwen3-coder", "glm"])
def test_the_end_marker_inside_a_value_is_the_values_text(family: str) -> None:
    """An agent writing a file that mentions `</tool_call>` (a chat template, this parser's tests): the
    marker inside a string value used to end the call there, and the rest leaked into the answer."""
    content = 'end = "</tool_call>"\nprint(end)\n'
    text = {"json": '<tool_call>\n' + json.dumps({"name": "write_file", "arguments": {"path": "a.py",
                                                                                      "content": content}})
            + '\n</tool_call>',
            "qwen3-coder": f"<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
                           f"<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>",
            "glm": f"<tool_call>write_file<arg_key>path</arg_key><arg_value>a.py</arg_value><arg_key>content"
                   f"</arg_key><arg_value>{content}</arg_value></tool_call>"}[family]
    tokenizer = {"json": QWEN, "qwen3-coder": CODER, "glm": GLM}[family]
    for size in (1, 4, len(text)):
        pieces, calls, answer = stream(tokenizer, text + "\nDone.", size)
        (call,) = calls
        expected = content.strip() if family == "glm" else content
        assert json.loads(call["arguments"]) == {"path": "a.py", "content": expected} and "partial" not in call
        assert answer.strip() == "Done."


def test_mistral_calls_stream_though_they_only_close_with_the_reply() -> None:
    """Devstral writes `[TOOL_CALLS]name[ARGS]{…}` with no end marker: its calls closed only at the end of
    the reply, so a long one sent nothing until then."""
    one, two = json.dumps({"path": "a.py", "content": "x" * 300}), json.dumps({"path": "b.py"})
    pieces, calls, answer = stream(MISTRAL, f"[TOOL_CALLS]write_file[ARGS]{one}write_file[ARGS]{two}", 2)
    assert [json.loads(call["arguments"]) for call in calls] == [json.loads(one), json.loads(two)]
    assert len([p for p in pieces if p["index"] == 0 and p["arguments"]]) > 20 and answer == ""
    assert calls[0]["arguments"].startswith(streamed(pieces, 0))
    pieces, (call,), _ = stream(MISTRAL, "[TOOL_CALLS]write_file[ARGS]" + one[:120], 3, cut=True)
    assert call["partial"] is True and call["arguments"] == one[:120] and one[:120].startswith(streamed(pieces, 0))


@pytest.mark.parametrize("schema,value,expected", [({"type": "string"}, "null", None),
                                                   ({"type": ["integer", "null"]}, "none", None),
                                                   ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "5", 5),
                                                   ({"type": "string"}, "  text  ", "text"),
                                                   (None, "abc", "abc")])
def test_minimax_values_stream_as_its_parser_converts_them(schema: dict | None, value: str, expected: object) -> None:
    properties = {"k": schema} if schema is not None else {}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": properties}}}]
    text = f'<minimax:tool_call>\n<invoke name="f">\n<parameter name="k">{value}</parameter>\n</invoke>\n' \
           "</minimax:tool_call>"
    parser = OutputParser(MINIMAX, in_thinking=False, tools=tools)
    deltas = [parser.feed(char, final=n == len(text) - 1) for n, char in enumerate(text)]
    (call,) = [call for delta in deltas for call in delta.tool_calls]
    sent = "".join(piece["arguments"] for delta in deltas for piece in delta.tool_call_deltas)
    assert call["arguments"].startswith(sent) and json.loads(call["arguments"]) == {"k": expected}
