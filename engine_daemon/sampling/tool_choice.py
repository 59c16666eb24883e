"""`tool_choice` of type `allowed_tools`: the tools a request may call, a subset of those it lists.

OpenAI's `allowed_tools` keeps the whole tool list (so a prompt cache stays warm) while the
model may call only the named ones. The front-ends send it as
`{"type": "allowed_tools", "mode": "auto" | "required", "tools": [names]}`:
- "required": the prompt describes every tool and the grammar forces a call among the
  allowed ones (`constraint_for`);
- "auto": free text cannot be constrained without also constraining the answer, so the prompt
  describes only the allowed tools (`template_tools`) and the output parser knows only them.
"""

from __future__ import annotations

from typing import Any

from engine_daemon.errors import RequestError

MODES = ("auto", "required")


def allowed_tools(tool_choice: Any) -> tuple[str, frozenset[str]] | None:
    """(mode, allowed function names) for an `allowed_tools` choice, None for any other choice."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "allowed_tools":
        return None
    mode, names = tool_choice.get("mode"), tool_choice.get("tools")
    if mode not in MODES:
        raise RequestError(400, "invalid_value", f"allowed_tools mode must be one of {list(MODES)}",
                           param="tool_choice")
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise RequestError(400, "invalid_value", "allowed_tools needs 'tools', a list of tool names",
                           param="tool_choice")
    return mode, frozenset(names)


def tool_name(tool: Any) -> str | None:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function.get("name") if isinstance(function, dict) else None


def narrowed(tools: list[dict[str, Any]] | None, names: frozenset[str]) -> list[dict[str, Any]]:
    """The tools among `tools` whose function name is allowed, in their order."""
    return [tool for tool in tools or () if tool_name(tool) in names]


def settled(tools: Any, tool_choice: Any) -> tuple[Any, Any]:
    """(tools a call may use, a plain tool_choice): `allowed_tools` becomes its mode over the allowed tools."""
    allowed = allowed_tools(tool_choice)
    if allowed is None:
        return tools, tool_choice
    mode, names = allowed
    kept = narrowed(tools if isinstance(tools, list) else None, names)
    if not kept:
        if mode == "required":
            raise RequestError(400, "invalid_value", "tool_choice allows no tool that 'tools' lists",
                               param="tool_choice")
        return [], "none"
    return kept, mode
