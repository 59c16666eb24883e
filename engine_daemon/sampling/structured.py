"""Structured output and forced tool calls, enforced by constrained decoding (llguidance).

`response_format` (`json_object`, `json_schema`) and `tool_choice` ("required" or a
named function) are promises about the output, so they are never taken as mere
hints: `constraint_for` turns them into a grammar and a logits processor that
masks every token the grammar does not allow, or refuses the request with a 400
when it cannot (bad schema, unknown tool, a tool-call format that is not JSON).

The llguidance tokenizer (the vocabulary as byte strings plus a token trie) is
built once per loaded tokenizer and kept on it: building it costs milliseconds
for a 2k vocabulary but about a second for a 150k one.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import replace
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from engine_daemon.errors import RequestError, describe
from engine_daemon.sampling.auto_calls import auto_call_rules
from engine_daemon.sampling.custom_grammar import InvalidGrammar, custom_lark, input_rule
from engine_daemon.sampling.grammar import GrammarConstraint
from engine_daemon.sampling.schema_depth import MAX_SCHEMA_DEPTH, schema_depth_within
from engine_daemon.sampling.strict_schema import strict_schema
from engine_daemon.sampling.tool_call_grammar import (
    FunctionSpec,
    can_offer_calls_beside_answer,
    json_rule,
    tool_calls_rules,
)
from engine_daemon.sampling.tool_choice import settled
from protocol.messages import STRICT_CLOSED

log = logging.getLogger(__name__)

# Schemas compiled into one grammar, in JSON bytes: a 100k-entry enum (~1 MB) compiles in ~0.5 s, 10 MB in ~8 s.
MAX_CONSTRAINT_BYTES = 1 << 20
PROBE_STEPS = 4  # tokens `first_steps_error` follows a new grammar for before it is used
_CACHE_ATTR = "_mlx_engined_llg_tokenizer"  # underscore: TokenizerWrapper keeps it on itself


class _TextOnlyTokenizer:
    """llguidance's tokenizer protocol (`llguidance.TokenizerWrapper`) over a built LLTokenizer, never
    encoding text as a special token.

    Why: llguidance turns the bytes a grammar forces (`"</think>"}` once a const's value is fixed) into
    the tokens the mask then allows, with the HF tokenizer's `encode`, which matches added tokens in
    text; but llguidance's vocabulary marks those same added tokens (every `<...>` one, Qwen's
    `</think>`, `<tool_call>` included) special, so they never spell text. The mask allowed only
    `</think>`'s id, the matcher refused it, and the request failed (500) at any temperature. Here a
    special token in an encoding is spelled with ordinary tokens instead; the vocabulary is the same
    bytes, the same special marks, so grammar references to special tokens (`<[id]>`) are unchanged.
    """

    is_tokenizer_wrapper = True  # llguidance's check for this protocol

    def __init__(self, built: LLTokenizer):
        self._built = built
        size = built.vocab_size
        self.eos_token_id: int = built.eos_token
        self.bos_token_id: int | None = None
        self.special_token_ids = [i for i in range(size) if built.is_special_token(i)]
        self.tokens = [built.decode_bytes([i]) for i in range(size)]  # special ones without llguidance's mark
        self._special = frozenset(self.special_token_ids)

    def __call__(self, text: str) -> list[int]:
        ids = self._built.tokenize_str(text)
        if self._special.isdisjoint(ids):
            return ids
        spelled: list[int] = []
        for token in ids:
            spelled += self._built.greedy_tokenize(self._built.decode_str([token])) if token in self._special \
                else [token]
        # An added token that strips the spaces around it took text its own does not spell: then all greedily.
        return spelled if self._built.decode_bytes(spelled) == text.encode() else self._built.greedy_tokenize(text)


def llg_tokenizer(tokenizer: Any) -> LLTokenizer:
    """The llguidance tokenizer for an mlx-lm TokenizerWrapper, built on first use and cached on it.

    Built from the HF tokenizer, then rebuilt over `_TextOnlyTokenizer` so that forced text is never
    encoded as a special token.
    """
    cached = getattr(tokenizer, _CACHE_ATTR, None)
    if cached is not None:
        return cached
    import llguidance.hf

    started = time.perf_counter()
    hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or []) or None
    try:
        from_hf = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos)
        built = LLTokenizer(_TextOnlyTokenizer(from_hf), eos_token=from_hf.eos_tokens)
    except Exception as exc:  # e.g. a slow (pure Python) tokenizer: llguidance needs tokenizer.json
        raise RequestError(400, "unsupported_value",
                           f"Constrained decoding is not available for this model's tokenizer: {describe(exc)}",
                           param="response_format") from None
    log.info("built the llguidance tokenizer (%d tokens) in %.3f s", built.vocab_size,
             time.perf_counter() - started)
    setattr(tokenizer, _CACHE_ATTR, built)
    return built


# -- request fields ------------------------------------------------------------------

def response_schema(response_format: Any) -> Any | None:
    """The JSON schema a `response_format` demands (with `strict`'s semantics when strict), or None for text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError(400, "invalid_type", "'response_format' must be an object", param="response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError(400, "invalid_value", "response_format type 'json_schema' needs a 'json_schema' "
                               "object", param="response_format.json_schema")
        schema = spec.get("schema", {})
        if schema is False or not isinstance(schema, (dict, bool)):
            raise RequestError(400, "invalid_value", "'response_format.json_schema.schema' must be a JSON schema "
                               "object that some value satisfies", param="response_format.json_schema.schema")
        strict = spec.get("strict")
        if strict is True or strict == STRICT_CLOSED:  # OpenAI's strict, or Anthropic's (`require_all=False`)
            return strict_schema(schema, require_all=strict is True)
        return schema
    raise RequestError(400, "unsupported_value", f"response_format type {kind!r} is not supported; use 'text', "
                       "'json_object' or 'json_schema'", param="response_format.type")


def function_specs(tools: Any) -> list[FunctionSpec]:
    """The function tools of a request (other tool types cannot be called through a grammar).

    A tool with `strict: true` gets its parameters with strict's semantics (`strict_schema`); one with
    `strict: "closed"` (Anthropic's strict, `STRICT_CLOSED`) gets its objects closed and `required` as written.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(400, "invalid_type", "'tools' must be an array", param="tools")
    specs = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError(400, "invalid_value", f"tools[{index}].function needs a non-empty 'name'",
                               param=f"tools[{index}].function.name")
        parameters = function.get("parameters")
        if parameters is None:  # OpenAI: no parameters means a function that takes none
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if parameters is False or not isinstance(parameters, (dict, bool)):
            raise RequestError(400, "invalid_value", f"tools[{index}].function.parameters must be a JSON schema "
                               "object", param=f"tools[{index}].function.parameters")
        strict = function.get("strict")
        if strict is True or strict == STRICT_CLOSED:
            parameters = strict_schema(parameters, require_all=strict is True)
        specs.append(FunctionSpec(name=name, parameters=parameters, index=index,
                                  strict=strict is True or strict == STRICT_CLOSED))
    return specs


def with_custom_grammars(specs: list[FunctionSpec]) -> list[FunctionSpec]:
    """Specs of custom tools with a Lark grammar get its arguments rule (built only for calls a grammar holds)."""
    return [replace(spec, arguments=_custom_rule(spec, lark)) if (lark := custom_lark(spec.parameters)) else spec
            for spec in specs]


def _custom_rule(spec: FunctionSpec, lark: str) -> str | None:
    """`input_rule` of a custom tool's grammar; a grammar no text can follow is the client's 400, naming the tool."""
    try:
        return input_rule(lark)
    except InvalidGrammar as exc:  # an UnicodeEncodeError in llguidance before: the engine's 500
        raise RequestError(400, "invalid_value", f"Invalid grammar for tool {spec.name!r}: {exc}",
                           param=f"tools[{spec.index}].function.parameters") from None


def forced_functions(specs: list[FunctionSpec], tool_choice: Any) -> list[FunctionSpec] | None:
    """The functions the output must call (tool_choice "required" or named), or None when not forced."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        name = None
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        # Chat Completions nests the name; the Responses API puts it on the choice itself.
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(400, "invalid_value", "tool_choice of type 'function' needs function.name",
                               param="tool_choice")
    else:
        raise RequestError(400, "invalid_value", "tool_choice must be 'none', 'auto', 'required' or "
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if not specs:
        raise RequestError(400, "invalid_value", "tool_choice forces a tool call, but 'tools' lists no functions",
                           param="tool_choice")
    if name is None:
        return specs
    chosen = [spec for spec in specs if spec.name == name]
    if not chosen:
        raise RequestError(400, "invalid_value", f"tool_choice names function {name!r}, which is not in 'tools'",
                           param="tool_choice")
    return chosen[:1]


# -- grammar --------------------------------------------------------------------------

def _compile(tokenizer: Any, lark: str) -> LLMatcher:
    """The matcher for a Lark grammar; llguidance reports grammar errors on it, never by raising."""
    return LLMatcher(llg_tokenizer(tokenizer), LLMatcher.grammar_from_lark(lark), log_level=0)


def _client_message(error: str) -> str:
    """An llguidance error without the position in, and the quote of, the engine's own grammar text."""
    lines = []
    for line in error.splitlines():
        if re.match(r"\s*\d+ \| ", line):
            break
        lines.append(line.strip())
    text = " ".join(line for line in lines if line)
    # A failure while matching carries the matcher's state and the whole grammar (~1 KB): not the client's.
    text = re.sub(r"<(state|grammar)>.*?(</\1>|$)", "", text, flags=re.DOTALL).strip()
    return re.sub(r"^at \d+\(\d+\): (failed to compile JSON schema: )?", "", text)


def _schema_error(tokenizer: Any, schema: Any) -> str | None:
    """Why llguidance rejects one JSON schema, or None when it compiles."""
    matcher = _compile(tokenizer, f"start: {json_rule(schema)}")
    return _client_message(matcher.get_error()) if matcher.is_error() else None


def _explain_failure(tokenizer: Any, schema: Any, specs: list[FunctionSpec], error: str) -> RequestError:
    """A 400 naming the schema that broke the grammar (checked one by one, only after a failure)."""
    if schema is not None and (why := _schema_error(tokenizer, schema)):
        return RequestError(400, "invalid_value", f"Invalid JSON schema in response_format: {why}",
                            param="response_format.json_schema.schema")
    for spec in specs:
        if why := _schema_error(tokenizer, spec.parameters):
            return RequestError(400, "invalid_value", f"Invalid JSON schema for tool {spec.name!r}: {why}",
                                param=f"tools[{spec.index}].function.parameters")
    return RequestError(400, "invalid_value", f"The output constraint could not be built: {_client_message(error)}",
                        param="response_format" if schema is not None else "tool_choice")


def first_steps_error(matcher: LLMatcher, vocab_size: int, steps: int = PROBE_STEPS) -> str | None:
    """Why a compiled grammar fails within its first tokens, or None.

    Some grammars compile and then fail on their first token, whichever it is (a required recursive
    `$ref`: llguidance's item limit; a regex of too many states): without this probe the request got a
    200 whose promised format was silently dropped. A copy of the matcher takes the lowest allowed token
    a few times, so the request's own matcher is untouched.
    """
    probe, mask = matcher.deep_copy(), allocate_token_bitmask(1, vocab_size)
    for _ in range(steps):
        if probe.is_stopped():
            return None
        fill_next_token_bitmask(probe, mask)
        if probe.is_error():
            return probe.get_error()
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size])
        if not len(allowed):
            return "the grammar allows no token"
        if not probe.consume_token(int(allowed[0])):
            return probe.get_error()
    return None


def check_constraint_size(schema: Any, specs: list[FunctionSpec], forced: bool) -> None:
    """Refuses schemas past MAX_CONSTRAINT_BYTES, or nested past MAX_SCHEMA_DEPTH, before compiling them.

    Why: a 10 MB enum took 8 s to refuse; a chain of ~1,100 `$defs` (80 KB, each referring to the next)
    crashed the whole engine inside llguidance's compile (its stack, not an exception).
    """
    size = len(json.dumps(schema, separators=(",", ":"))) if schema is not None else 0
    size += sum(len(json.dumps(spec.parameters, separators=(",", ":"))) + len(spec.arguments or "") for spec in specs)
    if size > MAX_CONSTRAINT_BYTES:
        raise RequestError(400, "invalid_value",
                           f"The output constraint's schemas are {size} bytes; at most {MAX_CONSTRAINT_BYTES} are "
                           "compiled into a grammar", param="tools" if forced or schema is None else "response_format")
    named = [(schema, "response_format")] if schema is not None else []
    named += [(spec.parameters, f"tools[{spec.index}].function.parameters") for spec in specs]
    for value, param in named:
        if not schema_depth_within(value, MAX_SCHEMA_DEPTH):
            raise RequestError(400, "invalid_value", f"The JSON schema in '{param}' nests deeper than "
                               f"{MAX_SCHEMA_DEPTH} levels (counting the schemas its $refs lead to)", param=param)


def _auto_rules(tokenizer: Any, specs: list[FunctionSpec], parallel: bool,
                starts_in_thinking: bool) -> tuple[list[str], int] | None:
    """`auto_call_rules` when a tool is strict and the tokenizer has an llguidance vocabulary (else not held)."""
    if not any(spec.strict for spec in specs):
        return None
    try:
        vocabulary = llg_tokenizer(tokenizer)
    except RequestError as exc:
        log.debug("strict tools under tool_choice auto are not constrained: %s", exc)
        return None
    return auto_call_rules(tokenizer, vocabulary, specs, parallel, starts_in_thinking)


def constraint_for(tokenizer: Any, response_format: Any, tools: Any, tool_choice: Any,
                   parallel_tool_calls: bool | None, starts_in_thinking: bool) -> GrammarConstraint | None:
    """The logits processor enforcing a request's output format, None when nothing is enforced.

    - tool_choice "required" / named function: one call (several when parallel_tool_calls,
      the default) in the model's tool-call markup, arguments following each tool's schema;
    - response_format json_object / json_schema: the answer is that JSON; when tools are
      offered with tool_choice "auto", a tool call (in marked families) is allowed instead;
    - tool_choice "auto" with a strict tool (marked families): free text, or calls held to the
      strict tools' schemas (`auto_calls`);
    - starts_in_thinking: the constraint applies after the model closes its thinking block.
    Raises RequestError (400) for what cannot be enforced.
    """
    schema = response_schema(response_format)
    tools, tool_choice = settled(tools, tool_choice)  # allowed_tools: its mode over the allowed tools
    specs = function_specs(tools) if tool_choice != "none" else []
    forced = forced_functions(specs, tool_choice)
    if forced or schema is not None:
        specs, forced = with_custom_grammars(specs), with_custom_grammars(forced or []) or None
    parallel = parallel_tool_calls is not False
    auto = _auto_rules(tokenizer, specs, parallel, starts_in_thinking) if not forced and schema is None else None
    marker = None
    if forced:
        rules, used = ["start: tool_calls", *tool_calls_rules(tokenizer, forced, parallel)], forced
        description = f"tool_choice={tool_choice if isinstance(tool_choice, str) else forced[0].name}"
    elif schema is not None:
        rules, used = ["start: answer", f"answer: {json_rule(schema)}"], []
        if specs and can_offer_calls_beside_answer(tokenizer):
            rules = ["start: answer | tool_calls", rules[1], *tool_calls_rules(tokenizer, specs, parallel)]
            used = specs
        description = f"response_format={response_format.get('type')}"
    elif auto is not None:
        (rules, marker), used = auto, [spec for spec in specs if spec.strict]
        description = "strict tool calls (tool_choice=auto)"
    else:
        return None
    check_constraint_size(schema, used, forced is not None)
    lark = "\n".join(rules) + "\n"
    started = time.perf_counter()
    matcher = _compile(tokenizer, lark)
    if matcher.is_error():
        raise _explain_failure(tokenizer, schema if not forced else None, used, matcher.get_error())
    vocabulary = llg_tokenizer(tokenizer)
    if (error := first_steps_error(matcher, vocabulary.vocab_size)) is not None:
        raise _explain_failure(tokenizer, schema if not forced else None, used, error)
    log.debug("compiled %s grammar in %.1f ms", description, (time.perf_counter() - started) * 1000)
    gate = getattr(tokenizer, "think_end_tokens", None) if starts_in_thinking else None
    eos = list(getattr(tokenizer, "eos_token_ids", None) or []) or [vocabulary.eos_token]
    return GrammarConstraint(matcher, vocabulary.vocab_size, eos, gate_tokens=gate, description=description,
                             call_marker=marker)
