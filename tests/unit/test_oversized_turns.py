"""A truncating chat too large to ever fit loses its oldest turns by their bytes, before any rendering."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from engine_daemon.request.preprocess import DROPPED_BY_SIZE, drop_oversized_turns


def loaded(window: int, longest: int) -> Any:
    return SimpleNamespace(context_window=window, _longest_token_bytes=longest)


def agent_history(rounds: int) -> list[dict[str, Any]]:
    """An agent session: a system prompt, one task, then rounds of a call and its result."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "fix the bug " + "x" * 20_000}]
    for i in range(rounds):
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": '{"p": "a"}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "y" * 500})
    return messages


def test_only_what_the_bytes_demand_goes_and_no_result_loses_its_call() -> None:
    body = {"messages": agent_history(5)}
    drop_oversized_turns(body, loaded(window=1000, longest=16))  # 16,000 bytes at most: the task must go
    roles = [message["role"] for message in body["messages"]]
    assert roles == ["system", "assistant", "tool", "assistant", "tool", "assistant", "tool", "assistant", "tool",
                     "assistant", "tool"], roles
    assert body[DROPPED_BY_SIZE] == 1


def test_a_cut_inside_a_round_takes_the_rounds_results_with_it() -> None:
    body = {"messages": agent_history(40)}  # ~20 KB of task plus 40 rounds of ~540 bytes
    drop_oversized_turns(body, loaded(window=1000, longest=16))
    kept = body["messages"]
    assert kept[0]["role"] == "system" and kept[1]["role"] == "assistant" and kept[-1]["role"] == "tool"
    calls = {call["id"] for message in kept for call in message.get("tool_calls", ())}
    assert all(message["tool_call_id"] in calls for message in kept if message["role"] == "tool")
    assert 0 < body[DROPPED_BY_SIZE] < 81 and len(kept) > 2
