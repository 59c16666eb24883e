"""Anthropic's bash, text editor and memory tools become callable function tools; turns that reach no model
and tool results that answer no tool_use are refused with the reason (front-end, fake engine)."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types.beta import (
    BetaMemoryTool20250818CreateCommand,
    BetaMemoryTool20250818DeleteCommand,
    BetaMemoryTool20250818InsertCommand,
    BetaMemoryTool20250818RenameCommand,
    BetaMemoryTool20250818StrReplaceCommand,
    BetaMemoryTool20250818ViewCommand,
)

from tests.unit.fake_engine import FakeEngine, client_for, usage

HELLO = [{"role": "user", "content": "hi"}]


def post(engine: FakeEngine, **body: Any):
    return client_for(engine).simulate_post("/v1/messages", json={"model": "m", "max_tokens": 16, "messages": HELLO,
                                                                  **body})


def offered(engine: FakeEngine) -> dict[str, dict[str, Any]]:
    return {tool["function"]["name"]: tool["function"] for tool in engine.added[-1].get("tools") or []}


@pytest.mark.parametrize("kind,name,undo", [
    ("text_editor_20241022", "str_replace_editor", True), ("text_editor_20250124", "str_replace_editor", True),
    ("text_editor_20250429", "str_replace_based_edit_tool", False),
    ("text_editor_20250728", "str_replace_based_edit_tool", False)])
def test_text_editor_tools_are_offered_with_their_documented_input(kind: str, name: str, undo: bool) -> None:
    engine = FakeEngine()
    result = post(engine, tools=[{"type": kind, "name": name}])
    assert result.status_code == 200, result.text
    schema = offered(engine)[name]["parameters"]
    assert schema["required"] == ["command", "path"]
    assert set(schema["properties"]) == {"command", "path", "file_text", "old_str", "new_str", "insert_line",
                                         "view_range"}
    assert schema["properties"]["command"]["enum"] == ["view", "create", "str_replace", "insert"] + (
        ["undo_edit"] if undo else [])
    assert "X-Ignored-Tools" not in result.headers


@pytest.mark.parametrize("kind", ["bash_20241022", "bash_20250124"])
def test_a_forced_bash_call_comes_back_as_a_tool_use_named_bash(kind: str) -> None:
    engine = FakeEngine(script=lambda request: [
        {"tool_calls": [{"id": "toolu_1", "name": "bash", "arguments": '{"command": "ls"}'}]},
        {"finish_reason": "tool_calls", "usage": usage(3)}])
    result = post(engine, tools=[{"type": kind, "name": "bash"}, {"type": "web_search_20250305", "name": "web"}],
                  tool_choice={"type": "any"})
    assert result.status_code == 200, result.text
    properties = offered(engine)["bash"]["parameters"]["properties"]
    assert properties["command"]["type"] == "string" and properties["restart"]["type"] == "boolean"
    assert engine.added[-1]["tool_choice"] == "required"
    (block,) = result.json["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "bash", {"command": "ls"})
    assert result.json["stop_reason"] == "tool_use"
    assert result.headers["X-Ignored-Tools"] == "web"  # hosted tools: left out and named, as before


MEMORY_COMMANDS = (BetaMemoryTool20250818ViewCommand, BetaMemoryTool20250818CreateCommand,
                   BetaMemoryTool20250818StrReplaceCommand, BetaMemoryTool20250818InsertCommand,
                   BetaMemoryTool20250818DeleteCommand, BetaMemoryTool20250818RenameCommand)


def test_the_memory_tool_is_offered_with_the_sdks_command_inputs() -> None:
    """`memory_20250818` was left out as a hosted tool: the model could not keep memories. It is a client tool: it is
    offered with every command and input the SDK's command types name, and is no longer named in X-Ignored-Tools."""
    engine = FakeEngine()
    result = post(engine, tools=[{"type": "memory_20250818", "name": "memory"}])
    assert result.status_code == 200, result.text
    schema = offered(engine)["memory"]["parameters"]
    commands = {command.model_fields["command"].annotation.__args__[0]: command for command in MEMORY_COMMANDS}
    assert schema["properties"]["command"]["enum"] == list(commands)
    fields = {field for command in MEMORY_COMMANDS for field in command.model_fields}
    assert set(schema["properties"]) == fields and schema["required"] == ["command"]
    assert schema["additionalProperties"] is False
    types = {"str": "string", "int": "integer"}
    for command in MEMORY_COMMANDS:
        for field, info in command.model_fields.items():
            if field != "command" and info.annotation in (str, int):
                assert schema["properties"][field]["type"] == types[info.annotation.__name__], field
    assert schema["properties"]["view_range"]["items"] == {"type": "integer"}
    assert "X-Ignored-Tools" not in result.headers
    assert post(FakeEngine(), tools=[{"type": "memory_20250818", "name": "notes"}]).status_code == 400


def test_a_forced_memory_call_comes_back_as_a_tool_use_named_memory() -> None:
    arguments = '{"command": "create", "path": "/memories/notes.md", "file_text": "fox"}'
    engine = FakeEngine(script=lambda request: [
        {"tool_calls": [{"id": "toolu_1", "name": "memory", "arguments": arguments}]},
        {"finish_reason": "tool_calls", "usage": usage(3)}])
    result = post(engine, tools=[{"type": "memory_20250818", "name": "memory"}],
                  tool_choice={"type": "tool", "name": "memory"})
    assert result.status_code == 200, result.text
    assert engine.added[-1]["tool_choice"] == {"type": "function", "function": {"name": "memory"}}
    (block,) = result.json["content"]
    assert (block["type"], block["name"]) == ("tool_use", "memory")
    assert BetaMemoryTool20250818CreateCommand.model_validate(block["input"]).file_text == "fox"


def test_a_client_tool_named_otherwise_is_a_400() -> None:
    result = post(FakeEngine(), tools=[{"type": "bash_20250124", "name": "shell"}])
    assert result.status_code == 400 and result.json["error"]["type"] == "invalid_request_error"
    assert "'bash'" in result.json["error"]["message"] and "tools.0.name" in result.json["error"]["message"]


def test_a_tool_result_answering_no_tool_use_is_refused_in_anthropics_words() -> None:
    engine = FakeEngine()
    orphan = {"type": "tool_result", "tool_use_id": "toolu_9", "content": "42"}
    result = post(engine, messages=[{"role": "user", "content": [orphan]}])
    assert result.status_code == 400 and not engine.added
    assert result.json["error"]["message"] == (
        "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9. Each "
        "`tool_result` block must have a corresponding `tool_use` block in the previous message.")
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "f", "input": {}}]}
    assert post(engine, messages=[*HELLO, call, {"role": "user", "content": [orphan]}]).status_code == 200
    # Only the turn just before counts: a result two turns later answers nothing.
    later = [*HELLO, call, {"role": "user", "content": [orphan]}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": [orphan]}]
    assert "messages.4.content.0: unexpected" in post(engine, messages=later).json["error"]["message"]
    # Consecutive assistant messages are one turn to Anthropic (a client may send its text and its calls apart).
    split = [*HELLO, call, {"role": "assistant", "content": [{"type": "text", "text": "Running it."}]},
             {"role": "user", "content": [orphan]}]
    assert post(engine, messages=split).status_code == 200


def test_a_user_turn_of_blocks_no_model_sees_is_named() -> None:
    upload = {"type": "container_upload", "file_id": "file_1"}
    result = post(FakeEngine(), messages=[{"role": "user", "content": [upload]}])
    assert result.status_code == 400
    message = result.json["error"]["message"]
    assert "messages.0 (container_upload)" in message and "does not pass to the model" in message
