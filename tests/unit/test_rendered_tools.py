"""The tools a chat template lists: Claude Code's deferred tools (`defer_loading`) stay out of the list."""

from __future__ import annotations

from engine_daemon.request.prompt import rendered_tools


def test_deferred_tools_leave_the_rendered_list_and_never_carry_the_flag_into_it() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    deferred = {**tool, "defer_loading": True}
    other = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    assert rendered_tools({"tools": [other, deferred]}) == [other]
    assert rendered_tools({"tools": [deferred]}) == [tool]  # all deferred: listed, without the flag
    assert rendered_tools({"tools": [other, deferred], "tool_choice": "none"}) is None
