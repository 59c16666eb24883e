"""Anthropic tool definitions and `tool_choice` -> the chat route's function tools and tool_choice.

Custom tools become function tools; Anthropic's client tools (bash, text editor, memory) get the input
schema Anthropic documents (`client_tools`); its hosted tools are left out (`hosted_tools`).

`strict: true` (Anthropic's strict tool use) reaches the engine as the function's `strict` with
Anthropic's meaning, `STRICT_CLOSED`: a constrained call follows the schema with every object closed
(Anthropic asks strict schemas to say `additionalProperties: false`; one that does not is closed
rather than refused) and `required` as written, so a property left out of it stays optional, as
Anthropic documents (not OpenAI's strict, which would require every property).
"""

from __future__ import annotations

from typing import Any

from http_frontend.anthropic.client_tools import CLIENT_TOOLS, client_tool
from http_frontend.errors import bad_request
from http_frontend.parsing.body import get_field, one_of
from http_frontend.parsing.generation_fields import parse_tool_choice, parse_tools
from protocol.messages import STRICT_CLOSED

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def deferred_tools(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Custom tools sent with `defer_loading: true` (Claude Code's tool search), by name."""
    tools = body.get("tools")
    return {tool["name"]: tool for tool in tools if isinstance(tool, dict) and tool.get("defer_loading") is True
            and isinstance(tool.get("name"), str) and tool.get("type", "custom") == "custom"} \
        if isinstance(tools, list) else {}


def hosted_tools(body: dict[str, Any]) -> list[str]:
    """The Anthropic-hosted tools of a request (`web_search_20250305`, `code_execution_…`, …): left out."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return []
    return [str(t.get("name") or t.get("type")) for t in tools if isinstance(t, dict) and isinstance(t.get("type"), str)
            and t["type"] != "custom" and t["type"] not in CLIENT_TOOLS]


def parse_anthropic_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Custom tools `{name, description, input_schema, strict}` as chat function tools.

    Anthropic's client tools (bash, text editor, memory) become function tools with their documented input
    (`client_tools`). Anthropic-hosted tools (a versioned `type` such as `web_search_20250305`) cannot
    run here: they are left out of the prompt (the route names them in `X-Ignored-Tools`), never a 400.
    """
    tools = get_field(body, "tools", (list,))
    if not tools:
        return None
    converted, strict = [], set()
    for index, tool in enumerate(tools):
        param = f"tools.{index}"
        if not isinstance(tool, dict):
            raise bad_request(f"{param}: expected an object", param=param, code="invalid_type")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"{param}.strict: expected a boolean", param=f"{param}.strict", code="invalid_type")
        if tool.get("type") is not None and not isinstance(tool["type"], str):  # named, where `one_of` says no
            raise bad_request(f"{param}.type: expected a string", param=f"{param}.type", code="invalid_type")
        if tool.get("type") in CLIENT_TOOLS:
            converted.append(client_tool(tool, param))
            strict |= {converted[-1]["function"]["name"]} if tool.get("strict") else set()
            continue
        if tool.get("type", "custom") != "custom" and isinstance(tool.get("type"), str):
            continue  # hosted: see hosted_tools
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"{param}: a tool needs a string 'name' and an 'input_schema' object", param=param,
                              code="invalid_type")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
        strict |= {tool["name"]} if tool.get("strict") else set()
    if not converted:
        return None
    deferred, checked = deferred_tools(body), []
    for entry in parse_tools({"tools": converted}):
        name = entry["function"]["name"]
        if name in strict:
            entry = {**entry, "function": {**entry["function"], "strict": STRICT_CLOSED}}
        checked.append({**entry, "defer_loading": True} if name in deferred else entry)
    return checked


def parse_anthropic_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None
                                ) -> tuple[str | dict[str, Any] | None, bool | None]:
    """`tool_choice` {type: auto|any|tool|none} -> (chat tool_choice, parallel_tool_calls)."""
    choice = get_field(body, "tool_choice", (dict,))
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name: a string is required when type is 'tool'", param="tool_choice.name",
                              code="invalid_type")
        mapped: str | dict[str, Any] = {"type": "function", "function": {"name": choice["name"]}}
    elif one_of(kind, TOOL_CHOICES):
        mapped = TOOL_CHOICES[kind]
    else:
        raise bad_request(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got {kind!r}",
                          param="tool_choice.type")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use: expected a boolean",
                          param="tool_choice.disable_parallel_tool_use", code="invalid_type")
    return parse_tool_choice({"tool_choice": mapped}, tools), (None if disable is None else not disable)

