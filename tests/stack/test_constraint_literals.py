"""Output constraints end to end (openai SDK / httpx -> front-end -> engine, the random-weight tiny model).

- A schema forcing text equal to a special token's text (`</think>`, `<tool_call>`) used to end
  every such request with a 500 `output_constraint_failed` (the stream sent `</think>` first).
- `strict: true` schemas without `additionalProperties: false` / `required` used to let the model
  add keys the schema never named and leave named ones out.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.helpers import Frontend, client_for

CONST_THINK_END = {"type": "object", "properties": {"v": {"type": "string", "const": "</think>"}},
                   "required": ["v"], "additionalProperties": False}
ECHO_MARKER = [{"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"v": {"type": "string", "enum": ["<tool_call>"]}}, "required": ["v"],
    "additionalProperties": False}}}]
LOOSE = {"type": "object", "properties": {"z": {"type": "string", "maxLength": 3}}}


def stream_chat(frontend: Frontend, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """(the content the deltas spell, every event) of a streamed chat completion."""
    events = []
    with httpx.stream("POST", f"{frontend.base_url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    content = "".join(event["choices"][0]["delta"].get("content") or "" for event in events if event.get("choices"))
    return content, events


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_forced_special_token_text_comes_back_as_text(frontend: Frontend, model_id: str,
                                                        temperature: float) -> None:
    client = client_for(frontend)
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": CONST_THINK_END}}
    messages = [{"role": "user", "content": "x"}]
    reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=30, seed=1,
                                           temperature=temperature, response_format=response_format)
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content) == {"v": "</think>"}

    content, events = stream_chat(frontend, {"model": model_id, "messages": messages, "max_tokens": 30,
                                             "temperature": temperature, "response_format": response_format})
    assert not [event for event in events if "error" in event], events
    assert json.loads(content) == {"v": "</think>"}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"

    call = client.chat.completions.create(model=model_id, messages=messages, max_tokens=60, seed=2,
                                          temperature=temperature, tools=ECHO_MARKER, tool_choice="required",
                                          parallel_tool_calls=False)
    assert call.choices[0].finish_reason == "tool_calls"
    [tool_call] = call.choices[0].message.tool_calls
    assert tool_call.function.name == "echo" and json.loads(tool_call.function.arguments) == {"v": "<tool_call>"}


def test_strict_schemas_hold_the_output_to_the_named_keys(frontend: Frontend, model_id: str) -> None:
    """Chat tools and response_format, and Responses' text.format, with a loose schema marked strict."""
    client = client_for(frontend)
    messages = [{"role": "user", "content": "x"}]
    for seed in range(3):
        call = client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=60, temperature=1.0, seed=seed,
            tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": LOOSE}}],
            tool_choice="required", parallel_tool_calls=False)
        [tool_call] = call.choices[0].message.tool_calls
        arguments = json.loads(tool_call.function.arguments)
        assert set(arguments) == {"z"} and len(arguments["z"]) <= 3, arguments

        answer = client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=60, temperature=1.0, seed=seed + 10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": LOOSE}})
        assert answer.choices[0].finish_reason == "stop"
        document = json.loads(answer.choices[0].message.content)
        assert set(document) == {"z"} and len(document["z"]) <= 3, document

    response = client.responses.create(
        model=model_id, input="x", max_output_tokens=60, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "x", "strict": True, "schema": LOOSE}})
    assert set(json.loads(response.output_text)) == {"z"}, response.output_text
