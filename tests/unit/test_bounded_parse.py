"""A family parser's time on one call is bounded: hostile output cannot hold the mlx thread (and every stream).

GLM-4.7's parser took 3.8 s on 40 KB of `<arg_key>a</arg_key><arg_value>` repeated (cubic: the
80 KB here would take about half a minute); a well-formed call of 300 KB parses in about a
millisecond and is untouched by the bound.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from mlx_lm.tool_parsers import gemma4, glm47, qwen3_coder

from engine_daemon.output.bounded_parse import bounded, timed_out
from engine_daemon.output.parser import OutputParser

HOSTILE = "f" + "<arg_key>a</arg_key><arg_value>" * (80_000 // 30)
TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}}]
BODY = ("def f(x):\n    return x * 2  # <b> [a(1)] {k: v}\n" * 7000)[:300_000]


@pytest.mark.parametrize("parser,text", [(glm47.parse_tool_call, HOSTILE),
                                         (gemma4.parse_tool_call, "call:f{" * 10_000)])
def test_a_hostile_call_runs_out_of_time(parser, text: str) -> None:
    with pytest.raises(TimeoutError):
        bounded(parser, seconds=0.05)(text, TOOLS)


def test_a_large_well_formed_call_is_parsed_in_full() -> None:
    text = (f"<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n{BODY}\n</parameter>\n"
            "</function>")
    assert bounded(qwen3_coder.parse_tool_call)(text, TOOLS)["arguments"]["content"] == BODY
    glm = (f"write<arg_key>path</arg_key><arg_value>a.py</arg_value><arg_key>content</arg_key>"
           f"<arg_value>{BODY}</arg_value>")
    assert bounded(glm47.parse_tool_call)(glm, TOOLS)["arguments"]["content"] == BODY.strip()
    # Outside a bounded parse the parsers' patterns match as before (no deadline).
    assert glm47.parse_tool_call(glm, TOOLS)["name"] == "write"


def test_the_output_parser_ends_a_hostile_call_as_the_call_it_read(caplog: pytest.LogCaptureFixture) -> None:
    before = timed_out()
    tokenizer = SimpleNamespace(think_start=None, think_end=None, tool_call_start="<tool_call>",
                                tool_call_end="</tool_call>", tool_parser=glm47.parse_tool_call)
    parser = OutputParser(tokenizer, in_thinking=False, tools=TOOLS)
    with caplog.at_level(logging.WARNING):
        pieces = [parser.feed(HOSTILE[i:i + 500]) for i in range(0, len(HOSTILE), 500)]
        parser.feed("<tool_call>")
        for i in range(0, len(HOSTILE), 500):
            parser.feed(HOSTILE[i:i + 500])
        end = parser.feed("</tool_call>", final=True)
    assert "ran past" in caplog.text and "glm47" in caplog.text
    assert timed_out() == before + 1  # `/stats` tool_parses_timed_out, `/metrics` its counter
    (call,) = end.tool_calls  # as far as it could be read: the name, the first key's value never closed
    assert call["name"] == "f" and call["partial"] is True and not end.text
    assert json.loads(call["arguments"] + '"}')["a"].startswith("<arg_key>a</arg_key><arg_value><arg_key>")
    assert "".join(p.text for p in pieces) == HOSTILE  # before the marker it was answer text
