"""Responses tools as agents send them -> the engine's function tools, and the calls back.

Codex CLI (0.169) sends more than `function` tools: `namespace` tools grouping function
and `custom` tools, `custom` (free-form) tools whose call carries raw text (optionally
under a Lark or regex grammar), hosted tools the engine cannot run (`web_search`,
`tool_search`, `file_search`, …), and, for its default model, all of them in an
`additional_tools` input item instead of `tools`. The engine knows only function
tools, so:

- every function tool of a namespace is offered under its own name (`namespace.name`
  only where two namespaces share a name), and its call goes back as a `function_call`
  with `name` and `namespace` apart: Codex answers `unsupported call: clock.sleep` to a
  joined name and runs `{"name": "sleep", "namespace": "clock"}` (tried against the
  real CLI);
- a custom tool is offered as a function with one string parameter, `input`, and its
  call goes back as a `custom_tool_call` whose `input` is that string. A regex grammar
  becomes the parameter's JSON-schema `pattern`, a Lark grammar its `x-lark`: both are
  shown to the model with the schema and hold a forced call (the engine rewrites the Lark
  grammar for the JSON-escaped text, `engine_daemon.sampling.custom_grammar`);
- hosted tools are left out of the prompt (logged; the route names them in
  `X-Ignored-Tools`), never a 400.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from http_frontend.errors import bad_request
from http_frontend.parsing.generation_fields import check_tool_count, function_tool, is_hosted_tool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolOrigin:
    """What a tool offered to the model is to the client: its kind, own name and namespace."""

    kind: str  # "function" | "custom"
    name: str
    namespace: str | None = None


@dataclass
class ToolCatalog:
    """The engine's function tools, where each came from, and the tools left out."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    origins: dict[str, ToolOrigin] = field(default_factory=dict)  # offered name -> origin
    ignored: list[str] = field(default_factory=list)

    def offered_name(self, name: str, namespace: str | None) -> str:
        """The name the model knows a client's (namespace, name) by (replayed calls use it too)."""
        for offered, origin in self.origins.items():
            if origin.name == name and origin.namespace == namespace:
                return offered
        return f"{namespace}.{name}" if namespace and name not in self.origins else name


def _custom_tool(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """A custom tool as a function taking its raw text in `input` (a regex grammar becomes the `pattern`)."""
    name = spec.get("name")
    description = spec.get("description") if isinstance(spec.get("description"), str) else ""
    schema: dict[str, Any] = {"type": "string", "description": "the tool's free-form input text"}
    fmt = spec.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if not isinstance(definition, str) or syntax not in ("lark", "regex"):
            raise bad_request(f"Invalid '{where}.format': a grammar needs 'syntax' ('lark' or 'regex') and a "
                              "'definition' string", param=f"{where}.format")
        if syntax == "regex":  # anchored: a JSON-schema pattern may match anywhere, the grammar is the whole input
            schema["pattern"] = f"^(?:{definition})$"
        else:  # the model reads it in the schema; the engine holds a forced call to it (`custom_lark`)
            schema["x-lark"] = definition
            description += "\n\nIts input follows the Lark grammar given as the `x-lark` of `input`."
    tool = function_tool({"name": name, "description": description.strip() or None,
                          "parameters": {"type": "object", "properties": {"input": schema}, "required": ["input"],
                                         "additionalProperties": False}}, where)
    return tool


def _add(catalog: ToolCatalog, pending: list[tuple[dict[str, Any], ToolOrigin]], tool: Any, where: str,
         namespace: str | None) -> None:
    if not isinstance(tool, dict):
        raise bad_request(f"Invalid type for '{where}': expected an object", param=where, code="invalid_type")
    kind = tool.get("type", "function")
    if kind == "function":
        entry = function_tool(tool, where)
        pending.append((entry, ToolOrigin("function", entry["function"]["name"], namespace)))
    elif kind == "custom":
        entry = _custom_tool(tool, where)
        pending.append((entry, ToolOrigin("custom", entry["function"]["name"], namespace)))
    elif kind == "namespace" and namespace is None:
        inner, name = tool.get("tools"), tool.get("name")
        if not isinstance(name, str) or not isinstance(inner, list):
            raise bad_request(f"Invalid '{where}': a namespace needs a 'name' and a 'tools' array", param=where)
        for index, member in enumerate(inner):
            _add(catalog, pending, member, f"{where}.tools[{index}]", name)
    elif is_hosted_tool(kind):
        catalog.ignored.append(str(tool.get("name") or kind))
    else:
        raise bad_request(f"Invalid '{where}': tools of type {kind!r} are not supported", param=where,
                          code="unsupported_parameter")


def build_catalog(tool_lists: list[tuple[Any, str]]) -> ToolCatalog:
    """Every tool of `tools` and of `additional_tools` items ((value, where) pairs), flattened and named."""
    catalog = ToolCatalog()
    pending: list[tuple[dict[str, Any], ToolOrigin]] = []
    for value, where in tool_lists:
        if value is None:
            continue
        if not isinstance(value, list):
            raise bad_request(f"Invalid type for '{where}': expected an array of tools", param=where,
                              code="invalid_type")
        for index, tool in enumerate(value):
            _add(catalog, pending, tool, f"{where}[{index}]", None)
    check_tool_count([entry for entry, _ in pending])
    counts: dict[str, int] = {}
    for _, origin in pending:
        counts[origin.name] = counts.get(origin.name, 0) + 1
    for entry, origin in pending:
        shared = counts[origin.name] > 1 and origin.namespace
        offered = f"{origin.namespace}.{origin.name}" if shared else origin.name
        if offered in catalog.origins:
            raise bad_request(f"Tool names must be unique: {offered!r} is given twice", param="tools",
                              code="invalid_value")
        entry["function"]["name"] = offered
        catalog.origins[offered] = origin
        catalog.tools.append(entry)
    if catalog.ignored:
        log.info("tools the engine cannot run were left out: %s", ", ".join(catalog.ignored))
    return catalog


def custom_input(arguments: str) -> str:
    """A custom call's raw text from the function-call arguments the model wrote (`{"input": …}`)."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments  # cut short (max tokens), or nested past what json follows: the text as written
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return parsed["input"]
    return arguments
