"""Strict function tools under tool_choice "auto": free text, and any call held to its tool's schema.

OpenAI's and Anthropic's `strict` promise that a call follows the tool's schema whenever the model
calls, not only when the call is forced; agents send tool_choice "auto" (the OpenAI Agents SDK makes
every function tool strict). So when a request offers at least one strict tool, the output is held to

    start: auto_body | auto_think_open
    auto_body: auto_think? AUTO_TEXT tool_calls?      (tool_calls: the family's markup, `tool_call_grammar`)
    AUTO_TEXT: any text that does not contain the call marker's text

The model writes free text (or ends: the text is complete anywhere, so every EOS token is allowed);
the marker token (Qwen/Hermes `<tool_call>`, Mistral `[TOOL_CALLS]`) starts the calls, which the
grammar then holds to the markup, a strict tool's arguments to its schema (`strict_schema`, per its
strictness) and a non-strict tool's to any JSON object (its schema was never promised, and may not
even compile). The marker spelled with ordinary tokens is refused: the output parser reads text, and
would take it for an unconstrained call. Special tokens are never text in llguidance, so the
thinking block a model opens itself (`<think>`, Qwen3 with thinking on) is a prefix of its own, free
inside, and may end the output unclosed; a prompt that ends inside one is gated as for every
constraint (`GrammarConstraint.gate`).

Only families whose calls begin with a marker token (`MARKED_FAMILIES`) can tell a call from an
answer as it starts; bare-JSON and XML-like families stay parsed, not constrained, as does a family
whose marker is not one special token of the vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine_daemon.sampling.tool_call_grammar import (
    MARKED_FAMILIES,
    FunctionSpec,
    family,
    lark_literal,
    tokens_rule,
    tool_calls_rules,
)

log = logging.getLogger(__name__)

ANY_OBJECT = {"type": "object"}  # a non-strict tool's arguments beside strict ones


def _special(vocabulary: Any, ids: Sequence[int] | None) -> bool:
    return bool(ids) and all(vocabulary.is_special_token(int(token)) for token in ids)


def call_marker(tokenizer: Any, vocabulary: Any) -> int | None:
    """The one special token every call of this family starts with, or None (then calls are not held)."""
    name = family(tokenizer)
    if name not in MARKED_FAMILIES:
        return None
    ids = getattr(tokenizer, "tool_call_start_tokens", None)
    if ids is None or len(ids) != 1 or not _special(vocabulary, ids):
        log.debug("strict tools under tool_choice auto are not constrained: the %s call marker %r is not one "
                  "special token (%s)", name, getattr(tokenizer, "tool_call_start", None), ids)
        return None
    return int(ids[0])


def auto_call_rules(tokenizer: Any, vocabulary: Any, specs: Sequence[FunctionSpec], parallel: bool,
                    starts_in_thinking: bool) -> tuple[list[str], int] | None:
    """The Lark rules (with `start`) and the marker token for calls under "auto", or None when not held."""
    if not any(spec.strict for spec in specs):
        return None
    marker = call_marker(tokenizer, vocabulary)
    if marker is None:
        return None
    held = [spec if spec.strict else replace(spec, parameters=ANY_OBJECT, arguments=None) for spec in specs]
    text = lark_literal(tokenizer.tool_call_start)
    rules = ["start: auto_body", "auto_body: AUTO_TEXT tool_calls?",
             f"AUTO_MARKED: /(?s:.*)/ {text} /(?s:.*)/", "AUTO_TEXT: /(?s:.*)/ & ~AUTO_MARKED"]
    think_start, think_end = (getattr(tokenizer, name, None) for name in ("think_start_tokens", "think_end_tokens"))
    if (not starts_in_thinking and getattr(tokenizer, "has_thinking", False) and _special(vocabulary, think_start)
            and _special(vocabulary, think_end)):
        rules[:2] = ["start: auto_body | auto_think_open", "auto_body: auto_think? AUTO_TEXT tool_calls?",
                     f"auto_think: auto_think_open {tokens_rule(think_end)}",
                     f"auto_think_open: {tokens_rule(think_start)} AUTO_THOUGHT", "AUTO_THOUGHT: /(?s:.*)/"]
    return [*rules, *tool_calls_rules(tokenizer, held, parallel)], marker
