"""Lark grammars (llguidance dialect) for a model family's tool-call markup.

A forced tool call must come out in the exact markup the model family's mlx-lm
tool parser reads back (`TokenizerWrapper.tool_parser`), so the engine's output
parser turns it into an OpenAI `tool_calls` entry. Only families whose call body
is JSON can be written as a grammar here; the others (XML-like parameters,
Python call syntax) are refused with a 400 rather than constrained into junk.

Markers are written as token ids (`<[id]>`), not text: the model then emits the
single marker token it was trained on (e.g. Qwen's `<tool_call>`), never the same
characters spelled with ordinary tokens, which a template would not produce.
Arguments are inline JSON schemas (`%json`), one per tool, so `$ref`s inside a
tool's `parameters` resolve against that tool's own schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_daemon.errors import RequestError

# Compact JSON (", " and ": ", no free whitespace). Why: with free whitespace a weak or
# random-weight model can pad JSON with whitespace tokens until max_tokens; compact JSON is
# also what chat templates render (`tojson`). A schema's own "x-guidance" still wins.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class FunctionSpec:
    """One function tool the output may call: its name and its arguments' JSON schema."""

    name: str
    parameters: Any
    index: int  # position in the request's `tools`, for error messages
    arguments: str | None = None  # a Lark rule for the arguments instead of `parameters` (custom tools)
    strict: bool = False  # `strict` (OpenAI's or Anthropic's): its calls are held to `parameters` under "auto" too


def lark_literal(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: Any) -> str:
    """`%json {...}` for a JSON schema, in the engine's compact JSON style unless the schema says otherwise."""
    if schema is True:
        schema = {}
    if isinstance(schema, dict):
        style = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**JSON_STYLE, **(style if isinstance(style, dict) else {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def tokens_rule(ids: Sequence[int]) -> str:
    return " ".join(f"<[{int(i)}]>" for i in ids)


def _marker(tokenizer: Any, text: str, ids: Sequence[int] | None) -> str:
    ids = ids if ids is not None else tokenizer.encode(text, add_special_tokens=False)
    return tokens_rule(ids) if ids else lark_literal(text)


def family(tokenizer: Any) -> str | None:
    """The mlx-lm tool parser module's name (`json_tools`, `mistral`, ...), or None without one."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return None
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or "unknown"


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else ""


def _object_calls(specs: Sequence[FunctionSpec], key: str) -> list[str]:
    """Rules `call_body: {"name": "<name>", "<key>": <arguments>}` (one alternative per tool) + argument rules."""
    lines = []
    bodies = []
    for n, spec in enumerate(specs):
        head = '{"name": ' + json.dumps(spec.name, ensure_ascii=False) + f', "{key}": '
        bodies.append(f"{lark_literal(head)} args_{n} {lark_literal('}')}")
        lines.append(f"args_{n}: {spec.arguments or json_rule(spec.parameters)}")
    return [f"call_body: {' | '.join(bodies)}", *lines]


def _json_tools(tokenizer: Any, specs: Sequence[FunctionSpec], parallel: bool) -> list[str]:
    """Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls joined by "\\n"."""
    start = _marker(tokenizer, tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = _marker(tokenizer, tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    repeat = ' ("\\n" tool_call)*' if parallel else ""
    return [f"tool_calls: tool_call{repeat}", f'tool_call: {start} "\\n" call_body "\\n" {end}',
            *_object_calls(specs, "arguments")]


def _mistral(tokenizer: Any, specs: Sequence[FunctionSpec], parallel: bool) -> list[str]:
    """Mistral: `[TOOL_CALLS]name[ARGS]{...}` (v11+ templates) or `[TOOL_CALLS] [{"name", "arguments"}]`."""
    start = _marker(tokenizer, tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    template = _template_text(tokenizer)
    if "[ARGS]" in template:
        args = _marker(tokenizer, "[ARGS]", None)
        heads = [f"{lark_literal(spec.name)} {args} args_{n}" for n, spec in enumerate(specs)]
        lines = [f"args_{n}: {spec.arguments or json_rule(spec.parameters)}" for n, spec in enumerate(specs)]
        return [f"tool_calls: tool_call{'+' if parallel else ''}", f"tool_call: {start} call_head",
                f"call_head: {' | '.join(heads)}", *lines]
    opening = " [" if "[TOOL_CALLS] [" in template else "["
    repeat = ' (", " call_body)*' if parallel else ""
    return [f'tool_calls: {start} {lark_literal(opening)} call_body{repeat} "]"', *_object_calls(specs, "arguments")]


def _bare_json(tokenizer: Any, specs: Sequence[FunctionSpec], parallel: bool) -> list[str]:
    """No family parser (e.g. Llama 3.x): the call is a bare JSON object, as the engine's JSON fallback reads it.

    Llama 3.1 templates ask for `"parameters"`; others get OpenAI's `"arguments"`.
    """
    key = "parameters" if '"parameters"' in _template_text(tokenizer) else "arguments"
    calls = ['tool_calls: call_body | "[" call_body (", " call_body)* "]"'] if parallel else ["tool_calls: call_body"]
    return [*calls, *_object_calls(specs, key)]


# Families whose call body is JSON (mlx_lm.tool_parsers module name -> rule builder).
FAMILIES: dict[str | None, Callable[[Any, Sequence[FunctionSpec], bool], list[str]]] = {
    "json_tools": _json_tools,
    "mistral": _mistral,
    None: _bare_json,
}

# Families whose output starts with a marker token, so an answer and a call can be told apart.
MARKED_FAMILIES = {"json_tools", "mistral"}


def supports_forced_calls(tokenizer: Any) -> bool:
    return family(tokenizer) in FAMILIES


def can_offer_calls_beside_answer(tokenizer: Any) -> bool:
    """Whether `answer | tool call` is unambiguous for this family (calls begin with a marker)."""
    return family(tokenizer) in MARKED_FAMILIES


def tool_calls_rules(tokenizer: Any, specs: Sequence[FunctionSpec], parallel: bool) -> list[str]:
    """Lark rules defining `tool_calls` for the model's family, or RequestError 400 when it has no JSON form."""
    name = family(tokenizer)
    build = FAMILIES.get(name)
    if build is None:
        raise RequestError(400, "unsupported_value",
                           f"This model's tool-call format ('{name}') cannot be enforced by constrained "
                           "decoding; use tool_choice \"auto\"", param="tool_choice")
    return build(tokenizer, specs, parallel)
