"""Tool calls cut by max_tokens, and whitespace around calls, from the engine's parser to each API's shape.

A cut call comes back as a call with its arguments as far as they got (OpenAI's
behaviour), never as markup text; a call cut before its name is complete is dropped.
Whitespace-only text next to tool-call markup is layout, not content. The stack tests
(tests/stack/test_cut_tool_calls.py) run the same over real processes and SDK clients.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine_daemon.output.parser import OutputParser, ParsedDelta, partial_call
from http_frontend.anthropic.stream import BlockBuilder, closed_json, stop_reason, tool_input
from http_frontend.engine.client import Update
from http_frontend.openai.responses_stream import ResponseBuilder
from http_frontend.openai.responses_tools import ToolOrigin
from tests.unit.test_output_parser import combined
from tests.unit.tokenizer_stubs import CODER, GLM, NO_PARSER, QWEN

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"},
                                     "days": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def run(tokenizer: SimpleNamespace, pieces: list[str], tools: list | None = TOOLS,
        cut: bool = True) -> tuple[list[ParsedDelta], ParsedDelta]:
    """Feeds `pieces`, the last one final; `cut`: max_tokens ended the generation (finish `length`)."""
    parser = OutputParser(tokenizer, in_thinking=False, tools=tools)
    deltas = [parser.feed(piece, final=i == len(pieces) - 1, cut=cut) for i, piece in enumerate(pieces)]
    return deltas, combined(deltas)


def agree(tokenizer: SimpleNamespace, text: str, tools: list | None = TOOLS, cut: bool = True) -> ParsedDelta:
    """The split of `text` fed whole, checked to be the split of it fed character by character."""
    _, whole = run(tokenizer, [text], tools, cut)
    _, chars = run(tokenizer, list(text), tools, cut)
    assert (chars.text, chars.reasoning) == (whole.text, whole.reasoning)
    strip = [{k: v for k, v in call.items() if k != "id"} for call in chars.tool_calls]
    assert strip == [{k: v for k, v in call.items() if k != "id"} for call in whole.tool_calls]
    return whole


# -- the engine's parser ------------------------------------------------------------------
@pytest.mark.parametrize("cut, arguments", [
    ('{"name": "get_weather"', ""),
    ('{"name": "get_weather", "arguments": ', ""),
    ('{"name": "get_weather", "arguments": {"city": "Os', '{"city": "Os'),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}', '{"city": "Oslo"}'),
])
def test_json_call_cut_in_its_arguments_is_a_partial_call(cut: str, arguments: str) -> None:
    total = agree(QWEN, "<tool_call>\n" + cut)
    (call,) = total.tool_calls
    assert (call["name"], call["arguments"], call["partial"]) == ("get_weather", arguments, True)
    assert total.text == ""


@pytest.mark.parametrize("cut", ["<tool", "<tool_call>", "<tool_call>\n", '<tool_call>\n{"na',
                                 '<tool_call>\n{"name": "get_wea'])
def test_call_cut_before_its_name_is_dropped(cut: str) -> None:
    total = agree(QWEN, cut)
    assert total.text == "" and not total.tool_calls


def test_second_of_two_calls_cut() -> None:
    total = agree(QWEN, CALL + "\n" + '<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [c.get("partial", False) for c in total.tool_calls] == [False, True]
    assert total.tool_calls[1]["arguments"] == '{"ci' and total.text == ""


def test_unforced_call_after_text_cut() -> None:
    total = agree(QWEN, 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert total.text == "Let me check."
    assert total.tool_calls[0]["arguments"] == '{"city": "Pa'


def test_qwen3_coder_cut_arguments_are_a_json_prefix() -> None:
    text = ("<tool_call>\n<function=get_weather>\n<parameter=zip>\n0150\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=city>\nOs")
    (call,) = agree(CODER, text).tool_calls
    # Strings stay strings where the schema says so ("0150"), other values are JSON.
    assert call["arguments"] == '{"zip": "0150", "days": 3, "city": "Os'
    assert closed_json(call["arguments"]) == {"zip": "0150", "days": 3, "city": "Os"}


def test_glm_cut_arguments_are_a_json_prefix() -> None:
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>da"
    (call,) = agree(GLM, text).tool_calls
    # GLM's own parser reads the finished pairs (dropping the cut one); the call is still marked cut.
    assert (call["name"], call["arguments"], call["partial"]) == ("get_weather", '{"city": "Oslo"}', True)


def test_an_unterminated_call_the_parser_reads_is_partial_only_when_cut() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert agree(QWEN, text).tool_calls[0]["partial"] is True
    assert "partial" not in agree(QWEN, text, cut=False).tool_calls[0]  # ended by EOS: a whole call


def test_a_cut_marker_start_is_dropped_but_one_character_is_text() -> None:
    assert agree(QWEN, "Checking.<tool_ca").text == "Checking."
    assert agree(QWEN, "x <").text == "x <"
    assert agree(QWEN, "Checking.<tool_ca", cut=False).text == "Checking.<tool_ca"  # a stop string, not a cut


def test_partial_call_needs_a_whole_name() -> None:
    assert partial_call('{"name": "get_wea') is None
    assert partial_call("<function=get_wea") is None
    assert partial_call("get_weath") is None
    assert partial_call("<function=f>\n<parameter=city>\nOslo\n</para")["arguments"] == '{"city": "Oslo'


def test_json_fallback_cut_call_naming_a_tool_is_a_call_and_other_json_is_text() -> None:
    total = agree(NO_PARSER, '{"name": "get_weather", "parameters": {"city": "Os')
    assert total.tool_calls[0]["arguments"] == '{"city": "Os' and total.text == ""
    other = agree(NO_PARSER, '{"name": "someone", "age": 4')
    assert other.text == '{"name": "someone", "age": 4' and not other.tool_calls


# -- whitespace next to calls ----------------------------------------------------------------------
@pytest.mark.parametrize("text, content", [
    (CALL + "\n" + CALL, ""),
    ("\n\n" + CALL + "\n\n" + CALL + "\n", ""),
    ("Sure.\n\n" + CALL, "Sure."),
    ("Sure. \n" + CALL + "\n\nDone.\n", "Sure.Done.\n"),
    (CALL + "\n", ""),
])
def test_whitespace_next_to_calls_is_not_text(text: str, content: str) -> None:
    total = agree(QWEN, text)
    assert total.text == content and len(total.tool_calls) == text.count("<tool_call>")


@pytest.mark.parametrize("text", ["  indented\n    code\n", "\n\nLeading newlines.", "a\n\nb\n\n", " "])
@pytest.mark.parametrize("cut", [False, True])
def test_an_answers_own_whitespace_is_kept(text: str, cut: bool) -> None:
    assert agree(QWEN, text, cut=cut).text == text
    assert agree(QWEN, text, tools=None, cut=cut).text == text


def test_no_whitespace_delta_is_streamed_between_calls() -> None:
    deltas, total = run(QWEN, [*CALL, "\n", *CALL, "\n", "\n"])
    assert not any(delta.text for delta in deltas) and len(total.tool_calls) == 2


# -- each API's shape ---------------------------------------------------------------------------------
PARTIAL = {"index": 0, "id": "call_1", "name": "get_weather", "arguments": '{"city": "Os', "partial": True}


@pytest.mark.parametrize("arguments, expected", [
    ("", {}), ("{", {}), ('{"city": ', {}), ('{"city": "Os', {"city": "Os"}),
    ('{"city": "Oslo", "da', {"city": "Oslo"}), ('{"days": 3, "zip": tr', {"days": 3}),
    ('{"a": ["x", {"b": "c', {"a": ["x", {"b": "c"}]}), ('{"city": "O\\u00', {"city": "O"}),
])
def test_anthropic_input_is_the_fields_written_so_far(arguments: str, expected: dict) -> None:
    assert tool_input(arguments) == expected


def test_anthropic_cut_call_is_a_tool_use_block_streamed_as_returned() -> None:
    builder = BlockBuilder()
    events = builder.feed(Update(tool_calls=[PARTIAL], finish_reason="length"))
    events += builder.finish()
    assert builder.blocks == [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Os"}}]
    streamed = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(streamed) == builder.blocks[0]["input"]
    assert stop_reason("length", None, builder.has_tool_use) == ("max_tokens", None)


def test_responses_cut_call_is_an_incomplete_function_call() -> None:
    from openai.types.responses import Response

    builder = ResponseBuilder({"id": "resp_1", "object": "response", "created_at": 1, "model": "m",
                               "parallel_tool_calls": True, "tool_choice": "required", "tools": []})
    events = builder.start() + builder.feed(Update(tool_calls=[PARTIAL], finish_reason="length"))
    assert [e["type"] for e in events if "output_text" in e["type"]] == []
    response = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert (item.type, item.status, item.arguments) == ("function_call", "incomplete", '{"city": "Os')


def test_responses_cut_custom_call_input_is_its_text() -> None:
    builder = ResponseBuilder({"id": "resp_1", "object": "response", "created_at": 1, "model": "m",
                               "parallel_tool_calls": True, "tool_choice": "auto", "tools": []},
                              origins={"apply_patch": ToolOrigin("custom", "apply_patch")})
    call = {**PARTIAL, "name": "apply_patch", "arguments": '{"input": "*** Begin Patch\\n*** Add'}
    events = builder.start() + builder.feed(Update(tool_calls=[call], finish_reason="length"))
    (item,) = events[-1]["response"]["output"]
    assert (item["type"], item["status"], item["input"]) == ("custom_tool_call", "incomplete",
                                                             "*** Begin Patch\n*** Add")


def test_arguments_nested_past_what_json_follows_are_no_500() -> None:
    """Red team: 1,000+ nested brackets in a cut call's arguments raised RecursionError: /v1/messages answered 500."""
    from http_frontend.openai.responses_tools import custom_input

    deep = '{"x": ' + "[" * 5000
    assert tool_input(deep) == {} and closed_json(deep) is None
    assert custom_input(deep) == deep  # a custom tool's input: the text as written
