"""Strict function tools under tool_choice "auto", at grammar level (`constraint_for`, `auto_calls`).

A strict tool's call was held to its schema only when forced (tool_choice required / named, Anthropic's
any / tool) or offered beside a response_format; under "auto", what agents send, it was parsed, not
constrained, and the model could write arguments that break the schema. Now the model writes free text
or ends, and once the call marker starts a call the call follows the markup and a strict tool's schema;
a non-strict tool beside it stays free (any JSON object).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from engine_daemon.sampling.grammar import GrammarConstraint
from engine_daemon.sampling.structured import constraint_for, llg_tokenizer
from tests.unit.grammar_checks import accepts, spell

LOOSE = {"type": "object", "properties": {"z": {"type": "string", "maxLength": 3}, "n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(tiny_model)


def tool(name: str, parameters: Any, strict: Any = True) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def auto(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool | None = None,
         in_thinking: bool = False) -> GrammarConstraint:
    constraint = constraint_for(tokenizer, None, tools, "auto", parallel, in_thinking)
    assert constraint is not None and constraint.call_marker == tokenizer.tool_call_start_tokens[0]
    return constraint


def call(tokenizer: Any, name: str, arguments: str) -> tuple[str, tuple[int, ...]]:
    """A call's body text (after the marker token) and the end token after it."""
    return f'\n{{"name": "{name}", "arguments": {arguments}}}\n', tuple(tokenizer.tool_call_end_tokens)


def text_then_call(constraint: GrammarConstraint, tokenizer: Any, text: str, name: str, arguments: str,
                   then: tuple[int, ...] = ()) -> bool:
    """Whether the grammar takes `text`, the marker token, then the call (and `then`), complete there."""
    matcher = constraint.matcher.deep_copy()
    body, end = call(tokenizer, name, arguments)
    return spell(matcher, tokenizer, text, then=tuple(tokenizer.tool_call_start_tokens)) \
        and accepts(matcher, tokenizer, body, then=end + then)


def test_text_then_a_strict_call_is_accepted_and_its_arguments_held(tokenizer: Any) -> None:
    constraint = auto(tokenizer, [tool("f", LOOSE)])
    assert text_then_call(constraint, tokenizer, "Let me check that.", "f", '{"z": "ab", "n": 1}')
    assert text_then_call(constraint, tokenizer, "", "f", '{"z": "ab", "n": 1}')  # a call at once
    assert not text_then_call(constraint, tokenizer, "", "f", '{"z": "ab", "n": 1, "q": 1}')  # a key never named
    assert not text_then_call(constraint, tokenizer, "", "f", '{"z": "ab"}')  # OpenAI's strict: all required
    assert not text_then_call(constraint, tokenizer, "", "f", '{"z": 5, "n": 1}')  # a wrong type
    assert not text_then_call(constraint, tokenizer, "", "f", '{"z": "abcd", "n": 1}')  # the schema's own bound
    assert not text_then_call(constraint, tokenizer, "", "g", "{}")  # a tool it does not offer


def test_text_alone_then_eos_is_accepted(tokenizer: Any) -> None:
    constraint = auto(tokenizer, [tool("f", LOOSE)])
    for eos in tokenizer.eos_token_ids:
        assert accepts(constraint.matcher, tokenizer, "Paris is sunny today.\n\nAnything else?", then=(eos,))
        assert accepts(constraint.matcher, tokenizer, "", then=(eos,))  # an empty reply


def test_the_marker_spelled_in_text_is_refused(tokenizer: Any) -> None:
    """The output parser reads text: `<tool_call>` written with ordinary tokens would start an unheld call."""
    constraint = auto(tokenizer, [tool("f", LOOSE)])
    assert not accepts(constraint.matcher, tokenizer, 'I call <tool_call>\n{"name": "f", "arguments": {}}')
    assert accepts(constraint.matcher, tokenizer, "I call <tool_ca11> and </tool_call>")


def test_a_non_strict_tools_call_is_free(tokenizer: Any) -> None:
    """Beside a strict tool, a non-strict one is called with any JSON object, never its (unpromised) schema,
    which need not even compile."""
    bogus = {"type": "bogus"}
    constraint = auto(tokenizer, [tool("f", LOOSE), tool("free", bogus, strict=None), tool("off", LOOSE, False)])
    assert text_then_call(constraint, tokenizer, "Hm.", "free", '{"anything": [1, {"b": null}]}')
    assert text_then_call(constraint, tokenizer, "", "off", '{"z": "abcdef", "q": true}')
    assert not text_then_call(constraint, tokenizer, "", "free", "[1]")  # still an object
    assert not text_then_call(constraint, tokenizer, "", "f", '{"z": "abcdef", "n": 1}')  # the strict one is held


def test_parallel_calls_and_a_single_one(tokenizer: Any) -> None:
    marker, eos = tokenizer.tool_call_start_tokens[0], min(tokenizer.eos_token_ids)
    body, end = call(tokenizer, "f", '{"z": "", "n": 0}')
    for parallel in (True, False):
        constraint = auto(tokenizer, [tool("f", LOOSE)], parallel=parallel)
        assert text_then_call(constraint, tokenizer, "", "f", '{"z": "", "n": 0}', then=(eos,))
        matcher = constraint.matcher.deep_copy()
        assert spell(matcher, tokenizer, "", then=(marker,))
        assert spell(matcher, tokenizer, body, then=end + (*tokenizer.encode("\n"), marker)) is parallel
        if parallel:  # a second call, then the end
            assert accepts(matcher, tokenizer, body, then=end + (eos,))


def test_anthropic_strict_keeps_properties_left_out_of_required_optional(tokenizer: Any) -> None:
    from http_frontend.anthropic.tools import parse_anthropic_tool_choice, parse_anthropic_tools

    body = {"tools": [{"name": "f", "input_schema": LOOSE, "strict": True}]}  # no tool_choice: auto
    tools = parse_anthropic_tools(body)
    choice, parallel = parse_anthropic_tool_choice(body, tools)
    constraint = constraint_for(tokenizer, None, tools, choice, parallel, False)
    assert constraint is not None
    assert text_then_call(constraint, tokenizer, "Noting it.", "f", '{"z": "ab"}')
    assert text_then_call(constraint, tokenizer, "", "f", "{}")
    assert not text_then_call(constraint, tokenizer, "", "f", '{"z": "ab", "q": 1}')  # closed


def test_nothing_is_held_without_a_strict_tool_or_under_none(tokenizer: Any) -> None:
    assert constraint_for(tokenizer, None, [tool("f", LOOSE, None), tool("g", LOOSE, False)], "auto", None,
                          False) is None
    assert constraint_for(tokenizer, None, [tool("f", LOOSE)], "none", None, False) is None
    assert constraint_for(tokenizer, None, [tool("f", LOOSE)], None, None, False) is not None  # default: auto


class _Family:
    """The tiny tokenizer posing as another tool-call family (its markers as mlx-lm names them)."""

    def __init__(self, wrapper: Any, module: str | None):
        import importlib

        parser = importlib.import_module(f"mlx_lm.tool_parsers.{module}") if module else None
        self._wrapper = wrapper
        self.tool_parser = parser.parse_tool_call if parser else None
        self.tool_call_start = parser.tool_call_start if parser else None
        self.tool_call_end = parser.tool_call_end if parser else None
        ids = wrapper.encode(self.tool_call_start, add_special_tokens=False) if parser else None
        self.tool_call_start_tokens = self.tool_call_end_tokens = ids
        self.chat_template = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper, name)


@pytest.mark.parametrize("module", [None, "pythonic", "mistral"])
def test_families_without_a_marker_token_stay_parsed_not_held(tokenizer: Any, module: str | None,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Bare JSON (no family parser) and XML-like / Python families cannot tell a call from text as it starts;
    Mistral's `[TOOL_CALLS]` is no special token in this vocabulary: not held, and a debug line says why."""
    with caplog.at_level(logging.DEBUG, logger="engine_daemon.sampling.auto_calls"):
        assert constraint_for(_Family(tokenizer, module), None, [tool("f", LOOSE)], "auto", None, False) is None
    if module == "mistral":
        assert "[TOOL_CALLS]" in caplog.text and "not one special token" in caplog.text


def test_a_thinking_block_the_model_opens_stays_free(tokenizer: Any) -> None:
    """Special tokens are never text: a model that opens `<think>` itself (Qwen3, thinking on) gets a free block,
    closed or cut by EOS; a prompt that ends inside one is gated until the block closes."""
    start, end = tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens)
    constraint = auto(tokenizer, [tool("f", LOOSE)])
    matcher = constraint.matcher.deep_copy()
    assert spell(matcher, tokenizer, "", then=start)
    assert accepts(matcher, tokenizer, "I spell <tool_call> freely here", then=(min(tokenizer.eos_token_ids),))
    assert accepts(matcher, tokenizer, "Weighing it.", then=end)
    assert spell(matcher, tokenizer, "Plan.", then=end)
    assert spell(matcher, tokenizer, "\n\nSure.", then=tuple(tokenizer.tool_call_start_tokens))
    body, close = call(tokenizer, "f", '{"z": "x", "n": 2}')
    assert accepts(matcher, tokenizer, body, then=close)
    gated = auto(tokenizer, [tool("f", LOOSE)], in_thinking=True)
    assert gated.gate == end and not gated.active


def test_eos_in_text_with_ignore_eos_goes_on_as_text(tokenizer: Any) -> None:
    """Before a call, an EOS is no grammar's end: with `ignore_eos` the text goes on, as without the grammar; once a
    call is complete its EOS ends the output even then."""
    constraint = auto(tokenizer, [tool("f", LOOSE)], parallel=False)
    eos, marker = min(tokenizer.eos_token_ids), tokenizer.tool_call_start_tokens[0]
    vocabulary = llg_tokenizer(tokenizer)
    logits = mx.zeros((1, vocabulary.vocab_size))
    context = [1, 2]
    constraint(mx.array(context), logits)
    assert not constraint.ends_output(eos)
    body, close = call(tokenizer, "f", '{"z": "a", "n": 3}')
    for token in [*vocabulary.tokenize_str("Hi"), eos, *vocabulary.tokenize_str(" more"), marker,
                  *vocabulary.tokenize_str(body), *close]:
        masked = constraint(mx.array(context), logits)
        assert masked[0, token].item() != float("-inf"), (token, tokenizer.decode(context[2:]))
        context.append(token)
    masked = constraint(mx.array(context), logits)
    assert not constraint.failed and constraint.ends_output(eos)
    assert {i for i, v in enumerate(masked[0].tolist()) if v != float("-inf")} == set(tokenizer.eos_token_ids)


def test_a_strict_schema_that_cannot_be_held_is_a_400_naming_it(tokenizer: Any) -> None:
    from engine_daemon.errors import RequestError

    with pytest.raises(RequestError) as info:
        constraint_for(tokenizer, None, [tool("ok", LOOSE), tool("bad", {"type": "bogus"})], "auto", None, False)
    assert info.value.status == 400 and info.value.param == "tools[1].function.parameters"
