"""The engine's split of generated text into answer, reasoning and tool calls (unit level).

The end-to-end behaviour (SDK clients, streaming vs not) is in test_tools_reasoning.py;
these pin the hold-back and state rules token by token.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from engine_daemon.output.parser import OutputParser, ParsedDelta
from tests.unit.tokenizer_stubs import NO_PARSER, QWEN

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def run(parser: OutputParser, pieces: list[str]) -> tuple[list[ParsedDelta], ParsedDelta]:
    deltas = [parser.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return deltas, combined(deltas)


def combined(deltas: list[ParsedDelta]) -> ParsedDelta:
    """What the deltas add up to: the whole text, reasoning and calls."""
    total = ParsedDelta()
    for delta in deltas:
        total.text += delta.text
        total.reasoning += delta.reasoning
        total.tool_calls += delta.tool_calls
    return total


def split_chars(text: str) -> list[str]:
    return list(text)


def test_reasoning_then_answer_char_by_char() -> None:
    parser = OutputParser(QWEN, in_thinking=True, tools=None)
    deltas, total = run(parser, split_chars("let me see</think>\n\nThe answer."))
    assert total.reasoning == "let me see"
    assert total.text == "The answer."
    # No delta ever carries part of the marker.
    assert all("<" not in d.text and "<" not in d.reasoning for d in deltas)


def test_model_opened_thinking_itself() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=None)
    _, total = run(parser, ["<think>", "hmm", "</think>", "ok"])
    assert (total.reasoning, total.text) == ("hmm", "ok")


def test_tool_call_is_parsed_and_markup_never_leaks() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas, total = run(parser, split_chars("Sure." + call))
    assert total.text == "Sure."
    assert len(total.tool_calls) == 1
    assert total.tool_calls[0]["name"] == "get_weather"
    assert json.loads(total.tool_calls[0]["arguments"]) == {"city": "Paris"}
    assert total.tool_calls[0]["id"].startswith("call_") and total.tool_calls[0]["index"] == 0
    assert parser.tool_calls == 1
    assert all("tool_call" not in d.text for d in deltas)


def test_two_calls_get_consecutive_indexes() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    one = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
    _, total = run(parser, [one, "\n", one.replace('"A"', '"B"')])
    assert [c["index"] for c in total.tool_calls] == [0, 1]
    assert [json.loads(c["arguments"])["city"] for c in total.tool_calls] == ["A", "B"]


def test_without_tools_markup_is_plain_text() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=None)
    _, total = run(parser, ["a <tool_call>x</tool_call>"])
    assert total.text == "a <tool_call>x</tool_call>" and not total.tool_calls


def test_a_call_cut_before_its_name_is_dropped_never_markup_text() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    _, total = run(parser, ["<tool_call>", '{"name": "get_wea'])
    assert total.text == "" and not total.tool_calls


def test_a_call_cut_in_its_arguments_is_a_partial_call() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    _, total = run(parser, ["<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Os'])
    assert total.text == ""
    (call,) = total.tool_calls
    assert (call["name"], call["arguments"], call["partial"]) == ("get_weather", '{"city": "Os', True)


def test_whitespace_between_and_after_calls_is_not_text() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for pieces in ([call, "\n", call, "\n"], list(call + "\n" + call + "\n\n")):
        parser = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
        deltas, total = run(parser, pieces)
        assert total.text == "" and len(total.tool_calls) == 2
        assert all(delta.text == "" for delta in deltas)  # streamed: no whitespace delta either


def test_an_answers_own_whitespace_is_kept_when_no_call_follows() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    _, total = run(parser, ["Line one.", "\n\n", "Line two.", "\n"])
    assert total.text == "Line one.\n\nLine two.\n" and not total.tool_calls


def test_a_complete_but_malformed_call_is_text() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    _, total = run(parser, ["<tool_call>", "not json at all", "</tool_call>", " after"])
    assert "not json at all" in total.text and not total.tool_calls


def test_partial_marker_is_held_then_released() -> None:
    parser = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    assert parser.feed("a <tool").text == "a"  # with tools, trailing whitespace waits too (`pending_space`)
    assert parser.feed("box").text == " <toolbox"


def test_json_fallback_for_families_without_a_parser() -> None:
    parser = OutputParser(NO_PARSER, in_thinking=False, tools=TOOLS)
    _, total = run(parser, [' {"name": "get_weather", ', '"parameters": {"city": "Oslo"}}'])
    assert total.text == "" and total.tool_calls[0]["name"] == "get_weather"
    assert json.loads(total.tool_calls[0]["arguments"]) == {"city": "Oslo"}
    plain = OutputParser(NO_PARSER, in_thinking=False, tools=TOOLS)
    _, total = run(plain, ["Hello", " {not json}"])
    assert total.text == "Hello {not json}" and not total.tool_calls


# -- red team: output a model may write ---------------------------------------------------------------
def test_a_json_answer_naming_a_tool_inside_is_no_call() -> None:
    """The JSON fallback took `{"items": [{"name": "get_weather", ...}]}` for a call with empty arguments."""
    parser = OutputParser(NO_PARSER, in_thinking=False, tools=TOOLS)
    answer = '{"items": [{"name": "get_weather", "qty": 2}]}'
    _, total = run(parser, split_chars(answer))
    assert total.text == answer and not total.tool_calls


def test_a_json_call_then_text_keeps_both() -> None:
    """`{call}\n\nI called f.` became one partial call whose arguments swallowed the text."""
    parser = OutputParser(NO_PARSER, in_thinking=False, tools=TOOLS)
    _, total = run(parser, ['{"name": "get_weather", "parameters": {"city": "Oslo"}}', "\n\nI called it."])
    (call,) = total.tool_calls
    assert json.loads(call["arguments"]) == {"city": "Oslo"} and not call.get("partial")
    assert total.text.strip() == "I called it."


def test_calls_with_nan_or_lone_surrogates_stay_valid_json_and_utf8() -> None:
    nan = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    _, total = run(nan, ['<tool_call>{"name": "get_weather", "arguments": {"x": [NaN]}}</tool_call>'])
    # Not JSON: never a whole call with `{"x": [NaN]}` as arguments; the call as written, `partial` (as when its
    # pieces were streamed before the NaN came), never markup as text.
    (call,) = total.tool_calls
    assert call["partial"] is True and call["arguments"] == '{"x": [NaN]}' and not total.text
    surrogate = OutputParser(QWEN, in_thinking=False, tools=TOOLS)
    _, total = run(surrogate, ['<tool_call>{"name": "get_weather", "arguments": {"x": "\\ud800"}}</tool_call>'])
    (call,) = total.tool_calls
    call["arguments"].encode("utf-8")  # the output frame is UTF-8: a lone surrogate stays an escape
    assert json.loads(call["arguments"]) == {"x": "\ud800"}


def test_partial_calls_survive_odd_schemas_and_deep_values() -> None:
    """A `true` property schema and 1,200 nested brackets raised inside the parser (and failed the batch)."""
    from engine_daemon.output.parser import partial_call

    odd = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": True}}}},
           {"type": "function", "function": {"name": "g", "parameters": {"properties": [1]}}}]
    for name in ("f", "g"):
        for text in (f"<function={name}><parameter=x>\n1\n</parameter>", f"<function={name}><parameter=x>\n[1"):
            assert partial_call(text, odd)["name"] == name
    deep = partial_call("<function=f><parameter=x>\n" + "[" * 1200 + "\n</parameter><parameter=y>", odd)
    assert deep["name"] == "f" and deep["arguments"].startswith('{"x": "[[[')


def test_a_call_a_stop_string_or_eos_cut_does_not_finish_as_tool_calls() -> None:
    from engine_daemon.output.tokens import _parsed

    whole = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    cut = '<tool_call>{"name": "get_weather", '
    for text, matched, expected in ((whole, None, "tool_calls"), (cut + '"arguments": {"a', None, "stop"),
                                    (whole, "END", "stop")):
        request = SimpleNamespace(parser=OutputParser(QWEN, in_thinking=False, tools=TOOLS), finish_reason="stop",
                                  stop=SimpleNamespace(matched=matched))
        _parsed(request, text)
        assert request.finish_reason == expected, (text, matched)


def test_output_that_breaks_its_parser_ends_only_its_own_request() -> None:
    """Red team: a parser exception on one request's output failed the whole step (every request in flight)."""
    from engine_daemon.config import SchedulerConfig
    from engine_daemon.models.manager import ModelManager
    from engine_daemon.scheduling.base import BaseScheduler
    from protocol import MsgType

    class Breaking:
        in_reasoning = False

        def feed(self, text: str, final: bool = False, cut: bool = False) -> ParsedDelta:
            raise RecursionError("maximum recursion depth exceeded")

    detokenizer = SimpleNamespace(add_token=lambda token: None, finalize=lambda: None, last_segment="x")
    stop = SimpleNamespace(feed=lambda text: text, flush=lambda: "", matched=None)
    request = SimpleNamespace(rid="r1", peer=b"p", seq=0, arrived=0.0, finish_reason=None, eos_token_ids=frozenset(),
                              detokenizer=detokenizer, generated=0, max_tokens=10, parser=Breaking(), stop=stop,
                              params={}, processors=[])
    scheduler = BaseScheduler(ModelManager(), SchedulerConfig())
    peer, kind, body = scheduler.token_event(request, 5)
    assert kind == MsgType.ERROR and body["status"] == 500 and body["rid"] == "r1", body
    assert request.finish_reason == "error"  # the batch takes it out; the others go on
