"""The families whose calls arrived whole now stream them too: Gemma 4, FunctionGemma, pythonic (LFM2),
Kimi K3, MiniCPM5, Muse Spark, LongCat, and Laguna (GLM's markup).

Fed as a model writes them, each call announces its id and name before it closes, streams arguments
that only grow, and closes as mlx-lm's own parser reads the same text, its arguments extending every
piece streamed.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from engine_daemon.output.call_text import SettledReader, call_dict
from engine_daemon.output.parser import OutputParser
from tests.unit.tokenizer_stubs import (
    FUNCTION_GEMMA,
    GEMMA4,
    KIMI3,
    LAGUNA,
    LONGCAT,
    MINICPM5,
    MUSE,
    PYTHONIC,
)

TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "mode": {"type": "integer"}}}}}]
CONTENT = "def f():\n    return {\"a\": [1, 2]}\n\n# café } ] 'q' \\n\n"
PLAIN = CONTENT.replace("}", ")")  # FunctionGemma's parser ends the arguments at the first `}`


def kimi3_argument(key: str, kind: str, value: str) -> str:
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'


def muse_parameter(key: str, value: str) -> str:
    return f'<atem:parameter name="{key}">{value}</atem:parameter>'


def pairs(tag: str, values: list[tuple[str, str]]) -> str:
    return "".join(f"<{tag}_key>{k}</{tag}_key><{tag}_value>{v}</{tag}_value>" for k, v in values)


VALUES = [("path", "src/a.py"), ("content", CONTENT), ("mode", "644")]
CALLS = {
    "gemma4": (GEMMA4, 'call:write_file{path:<|"|>src/a.py<|"|>,content:<|"|>' + CONTENT
               + '<|"|>,mode:644,extra:{deep:[1,<|"|>x<|"|>]}}'),
    "function_gemma": (FUNCTION_GEMMA, f"call:write_file{{path:<escape>src/a.py<escape>,content:<escape>{PLAIN}"
                                       "<escape>,mode:644}"),
    "pythonic": (PYTHONIC, f'[write_file(path="src/a.py", content={json.dumps(CONTENT)}, mode=644, '
                           f"note={CONTENT!r}, flags=[true, None])]"),
    "kimi_k3": (KIMI3, '<|open|>call tool="write_file" index="1"<|sep|>' + kimi3_argument("path", "string", "src/a.py")
                + kimi3_argument("content", "string", CONTENT) + kimi3_argument("mode", "integer", "644")
                + "<|close|>call<|sep|>"),
    "minicpm5": (MINICPM5, '"write_file"><param name="path">src/a.py</param><param name="content"><![CDATA['
                 + CONTENT + ']]></param><param name="mode">644</param>'),
    "muse_spark": (MUSE, '<atem:invoke name="write_file">' + "".join(muse_parameter(k, v) for k, v in VALUES)
                   + "</atem:invoke>"),
    "longcat": (LONGCAT, "write_file" + pairs("longcat_arg", VALUES)),
    "laguna": (LAGUNA, "write_file" + pairs("arg", VALUES)),
}


def expected(tokenizer: SimpleNamespace, call_text: str) -> dict[str, Any]:
    """mlx-lm's reading of the call, as the engine returns it."""
    (call,) = call_dict(tokenizer.tool_parser(call_text, TOOLS))
    return call


def stream(tokenizer: SimpleNamespace, text: str, size: int) -> tuple[list[dict], list[dict], str, int]:
    """(pieces, whole calls, answer text, pieces sent before the first whole call) of `text` fed `size` at a time."""
    parser = OutputParser(tokenizer, in_thinking=False, tools=TOOLS)
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    pieces: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    answer, early = "", 0
    for number, chunk in enumerate(chunks):
        delta = parser.feed(chunk, final=number == len(chunks) - 1)
        for call in delta.tool_calls:
            assert call["arguments"].startswith(streamed(pieces, call["index"]))
        early += len(delta.tool_call_deltas) if not calls and not delta.tool_calls else 0
        pieces += delta.tool_call_deltas
        calls += delta.tool_calls
        answer += delta.text
    return pieces, calls, answer, early


def streamed(pieces: list[dict], index: int) -> str:
    return "".join(p["arguments"] for p in pieces if p["index"] == index)


@pytest.mark.parametrize("family", sorted(CALLS))
@pytest.mark.parametrize("size", [1, 3, 17])
def test_a_calls_arguments_stream_while_it_is_written(family: str, size: int) -> None:
    tokenizer, call_text = CALLS[family]
    text = f"Writing it.{tokenizer.tool_call_start}{call_text}{tokenizer.tool_call_end}\nDone."
    pieces, calls, answer, early = stream(tokenizer, text, size)
    (call,) = calls
    assert {k: call[k] for k in ("name", "arguments")} == expected(tokenizer, call_text) and "partial" not in call
    assert answer.replace("\n", "") == "Writing it.Done."
    first = pieces[0]
    assert (first["index"], first["id"], first["name"]) == (call["index"], call["id"], "write_file")
    assert all("name" not in p for p in pieces[1:])
    sent = streamed(pieces, call["index"])
    assert call["arguments"].startswith(sent) and len(sent) > len(call["arguments"]) // 2, (sent, call["arguments"])
    assert early > (1 if size == 17 else 5)


@pytest.mark.parametrize("family", sorted(CALLS))
def test_settled_arguments_only_grow_and_end_as_the_whole_call(family: str) -> None:
    """Every reading extends the one before; the last, of the whole call, is its arguments but the `}`."""
    tokenizer, call_text = CALLS[family]
    reader = SettledReader(TOOLS, tokenizer.tool_parser)
    before = ""
    for end in range(len(call_text) + 1):
        settled = reader.read(call_text[:end])
        if settled is not None:
            assert settled[1].startswith(before), (call_text[:end], before, settled[1])
            before = settled[1]
    assert before == expected(tokenizer, call_text)["arguments"][:-1]


@pytest.mark.parametrize("family", ["gemma4", "function_gemma", "pythonic", "kimi_k3", "muse_spark", "longcat"])
def test_the_end_marker_inside_a_string_is_the_strings_text(family: str) -> None:
    tokenizer, _ = CALLS[family]
    content = f"He said \"hi\": '{tokenizer.tool_call_end}'\n"  # Python writes it in single quotes
    call_text = {"gemma4": f'call:write_file{{content:<|"|>{content}<|"|>}}',
                 "function_gemma": f"call:write_file{{content:<escape>{content}<escape>}}",
                 "pythonic": f"[write_file(content={content!r})]",
                 "kimi_k3": '<|open|>call tool="write_file"<|sep|>' + kimi3_argument("content", "string", content)
                            + "<|close|>call<|sep|>",
                 "muse_spark": '<atem:invoke name="write_file">' + muse_parameter("content", content)
                               + "</atem:invoke>",
                 "longcat": "write_file" + pairs("longcat_arg", [("content", content)])}[family]
    for size in (1, 4, 1000):
        text = f"{tokenizer.tool_call_start}{call_text}{tokenizer.tool_call_end}Done."
        pieces, (call,), answer, _ = stream(tokenizer, text, size)
        assert {k: call[k] for k in ("name", "arguments")} == expected(tokenizer, call_text) and answer == "Done."
        assert tokenizer.tool_call_end in json.loads(call["arguments"])["content"]


@pytest.mark.parametrize("family", ["gemma4", "pythonic", "kimi_k3"])
def test_a_malformed_call_once_announced_ends_partial_not_as_text(family: str) -> None:
    tokenizer, _ = CALLS[family]
    call_text = {"gemma4": 'call:write_file{path:<|"|>a.py<|"|>,content:<|"|>' + "x" * 80 + '<|"|> oops',
                 "pythonic": '[write_file(path="a.py", content="' + "x" * 80 + '" oops',
                 "kimi_k3": '<|open|>call tool="write_file"<|sep|>' + kimi3_argument("path", "string", "a.py")
                            + '<|open|>argument key="content"<|sep|>' + "x" * 80}[family]
    pieces, (call,), answer, _ = stream(tokenizer, f"{tokenizer.tool_call_start}{call_text}{tokenizer.tool_call_end}",
                                        3)
    assert answer == "" and call["partial"] is True and call["name"] == "write_file"
    assert call["arguments"].startswith(streamed(pieces, 0)) and streamed(pieces, 0).startswith('{"path": "a.py"')


@pytest.mark.parametrize("literal,held", [('"a\\x4', 'a'), ('"a\\x41b', "aAb"), ('"a\\\\', "a"), ('"a\\1', "a"),
                                          ('"""a""', "a"), ('"\\N{LATIN SMALL LETTER E WITH ACUTE}x', "éx")])
def test_a_python_string_streams_up_to_its_last_whole_escape(literal: str, held: str) -> None:
    reader = SettledReader(TOOLS, PYTHONIC.tool_parser)
    assert reader.read(f"[write_file(content={literal}") == ("write_file", '{"content": "' + held)


OPENINGS = {"muse_spark": (MUSE, '<atem:invoke name="f"><atem:parameter name="k">'),
            "minicpm5": (MINICPM5, '"f"><param name="k">'),
            "longcat": (LONGCAT, "f<longcat_arg_key>k</longcat_arg_key><longcat_arg_value>")}


@pytest.mark.parametrize("family,value,schema,streams", [
    ("muse_spark", "hello", None, True), ("muse_spark", "nul", None, False), ("muse_spark", "12", None, False),
    ("muse_spark", "null x", None, True), ("minicpm5", "nul", {"type": "string"}, False),
    ("minicpm5", "5", {"type": "integer"}, False), ("minicpm5", "<![CDATA[ a ", {"type": "string"}, True),
    ("longcat", "5", {"type": "integer"}, False)])
def test_a_value_the_family_may_convert_is_held_until_it_closes(family: str, value: str, schema: dict | None,
                                                                streams: bool) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"k": schema} if schema else {}}}}]
    tokenizer, opening = OPENINGS[family]
    _, arguments = SettledReader(tools, tokenizer.tool_parser).read(opening + value)
    assert arguments.startswith('{"k": ') and (arguments != '{"k": ') == streams, arguments


# Found by fuzzing (random values, chunk sizes and delimiters written inside values).
FUZZED = {
    # FunctionGemma's parser ends the arguments at the first `}`, in a string or not: the end marker after it
    # is the call's end, not a string's text (the answer after it was lost).
    "function_gemma": (FUNCTION_GEMMA, "call:f{a:<escape>x<escape>,b:y<escape>}"),
    # A parameter after `</atem:invoke>` is not the call's (it streamed as one).
    "muse_spark": (MUSE, '<atem:invoke name="f"><atem:parameter name="a">x</atem:parameter></atem:invoke>'
                         '<atem:parameter name="b">5</atem:parameter>'),
    # Nor is an argument after `<|close|>call<|sep|>`.
    "kimi_k3": (KIMI3, '<|open|>call tool="f"<|sep|>' + kimi3_argument("a", "string", "x") + "<|close|>call<|sep|>"
                + kimi3_argument("b", "integer", "5")),
}


@pytest.mark.parametrize("family", sorted(FUZZED))
@pytest.mark.parametrize("size", [1, 3, 17])
def test_fuzzed_calls_close_as_mlx_lm_reads_them(family: str, size: int) -> None:
    tokenizer, call_text = FUZZED[family]
    text = f"{tokenizer.tool_call_start}{call_text}{tokenizer.tool_call_end} Done."
    pieces, (call,), answer, _ = stream(tokenizer, text, size)
    assert {k: call[k] for k in ("name", "arguments")} == expected(tokenizer, call_text) and answer == "Done."
    assert call["arguments"].startswith(streamed(pieces, 0)) and "partial" not in call


def test_a_markup_call_its_parser_refuses_ends_partial_though_its_values_are_whole() -> None:
    """Kimi K3's parser needs `<|close|>call<|sep|>`: without it the call, its arguments all closed, was
    returned whole (the arguments as written made a JSON object), not as the malformed call it is."""
    call_text = '<|open|>call tool="write_file"<|sep|>' + kimi3_argument("path", "string", "a.py") + "junk"
    pieces, (call,), answer, _ = stream(KIMI3, f"{KIMI3.tool_call_start}{call_text}{KIMI3.tool_call_end}", 2)
    assert call["partial"] is True and call["arguments"] == '{"path": "a.py"}' and answer == ""


def test_minicpm5s_name_pattern_reads_only_minicpm5s_calls() -> None:
    """Fuzzed: Gemma 4 junk (`12>x`) matched MiniCPM5's loose `"f">` name and came back as a call named 12."""
    text = '<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|><|tool_call>12>x<tool_call|>'
    _, calls, answer, _ = stream(GEMMA4, text, 3)
    assert [call["name"] for call in calls] == ["f"] and "12>x" in answer


@pytest.mark.parametrize("family", ["gemma4", "pythonic"])
@pytest.mark.parametrize("size", [1, 1000])
def test_a_cut_bracketed_call_is_the_call_as_far_as_it_settled_however_it_was_fed(family: str, size: int) -> None:
    """max_tokens cut the call: streamed or fed whole, it is the call as far as its reader read it, partial
    (fed whole it was dropped: `partial_call` reads no bracketed call)."""
    tokenizer = {"gemma4": GEMMA4, "pythonic": PYTHONIC}[family]
    text = tokenizer.tool_call_start + {"gemma4": 'call:write_file{path:<|"|>a.py<|"|>,content:<|"|>abc',
                                        "pythonic": '[write_file(path="a.py", content="abc'}[family]
    parser = OutputParser(tokenizer, in_thinking=False, tools=TOOLS)
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    deltas = [parser.feed(chunk, final=n == len(chunks) - 1, cut=True) for n, chunk in enumerate(chunks)]
    (call,) = [call for delta in deltas for call in delta.tool_calls]
    assert call["partial"] is True and call["arguments"] == '{"path": "a.py", "content": "abc'
    assert not "".join(delta.text for delta in deltas)


@pytest.mark.parametrize("size", [1, 3, 17])
def test_kimi_k3s_json_block_streams_as_written(size: int) -> None:
    arguments = json.dumps({"path": "src/a.py", "content": CONTENT, "mode": 644}, separators=(",", ":"))
    call_text = '<|open|>call tool="write_file" index="1"<|sep|><|open|>json type="object"<|sep|>' + arguments \
        + "<|close|>json<|sep|><|close|>call<|sep|>"
    text = f"{KIMI3.tool_call_start}{call_text}{KIMI3.tool_call_end}"
    pieces, (call,), answer, early = stream(KIMI3, text, size)
    assert json.loads(call["arguments"]) == json.loads(expected(KIMI3, call_text)["arguments"]) and answer == ""
    assert call["arguments"] == arguments and arguments.startswith(streamed(pieces, 0)) and early > 1


def test_a_pythonic_call_that_is_no_python_streams_no_decoded_string() -> None:
    """Fuzzed: `in=` (a keyword as a key) is no Python, so mlx-lm's fallback regex reads the call and keeps
    a string's escapes as written; the string had streamed decoded (`\\n` as a newline)."""
    call_text = '[write_file(in="x\\ny", path="a\\nb")]'  # a keyword after a string is undecidable till then
    pieces, (call,), _, _ = stream(PYTHONIC, f"{PYTHONIC.tool_call_start}{call_text}{PYTHONIC.tool_call_end}", 1)
    assert {k: call[k] for k in ("name", "arguments")} == expected(PYTHONIC, call_text)
    assert call["arguments"].startswith(streamed(pieces, 0)) and "partial" not in call
