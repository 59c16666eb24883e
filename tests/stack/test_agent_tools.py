"""Codex-style tools through the real stack (httpx -> gunicorn -> engined with the tiny model).

Random weights make free answers nonsense, so every call here is forced: constrained
decoding makes its shape deterministic. What is checked is what an agent parses back:
a namespace tool's call carries `name` + `namespace`, a custom tool's call is a
`custom_tool_call` whose `input` follows the tool's grammar (Lark or regex) through
the JSON markup, and hosted tools are left out and named, never a 400.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from tests.helpers import Frontend

# A finite Lark grammar with a newline and a quote: the rewrite for JSON strings must carry both.
LARK = 'start: ("ls" | "pwd") " -" ("a" | "l") QUOTE LF\nQUOTE: "\\""\n%import common.LF\n'
LARK_INPUT = re.compile(r'^(ls|pwd) -[al]"\n$')
EXEC = {"type": "custom", "name": "exec", "description": "Runs a shell command",
        "format": {"type": "grammar", "syntax": "lark", "definition": LARK}}
PICK = {"type": "custom", "name": "pick", "format": {"type": "grammar", "syntax": "regex", "definition": "(yes|no)"}}
CLOCK = {"type": "namespace", "name": "clock", "description": "Time tools", "tools": [
    {"type": "function", "name": "sleep", "description": "Sleeps",
     "parameters": {"type": "object", "properties": {"ms": {"type": "integer", "maximum": 9}}, "required": ["ms"],
                    "additionalProperties": False}}, EXEC]}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "image_generation"}]


def post(frontend: Frontend, model: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{frontend.base_url}/v1/responses", timeout=60,
                      json={"model": model, "input": "Go.", "temperature": 0, "max_output_tokens": 80, **body})


def test_a_forced_namespace_call_names_its_namespace(frontend: Frontend, model_id: str) -> None:
    result = post(frontend, model_id, tools=[CLOCK, *HOSTED],
                  tool_choice={"type": "function", "name": "sleep", "namespace": "clock"})
    assert result.status_code == 200, result.text
    assert result.headers["X-Ignored-Tools"] == "web_search,image_generation"
    (call,) = result.json()["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "sleep", "clock")
    assert 0 <= json.loads(call["arguments"])["ms"] <= 9


def test_a_forced_custom_call_follows_its_lark_grammar(frontend: Frontend, model_id: str) -> None:
    result = post(frontend, model_id, tools=[CLOCK], tool_choice={"type": "custom", "name": "exec"})
    assert result.status_code == 200, result.text
    (call,) = result.json()["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("custom_tool_call", "exec", "clock")
    assert LARK_INPUT.match(call["input"]), call["input"]
    # Replayed with its output, the conversation goes on (Codex sends both items back).
    replay = [{"role": "user", "content": "Go."}, call,
              {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "a.txt"}]
    again = post(frontend, model_id, input=replay, tools=[CLOCK], tool_choice={"type": "custom", "name": "exec"})
    assert again.status_code == 200, again.text
    assert LARK_INPUT.match(again.json()["output"][0]["input"])


def test_a_forced_custom_call_streams_its_input(frontend: Frontend, model_id: str) -> None:
    with httpx.stream("POST", f"{frontend.base_url}/v1/responses", timeout=60, json={
            "model": model_id, "input": "Go.", "temperature": 0, "max_output_tokens": 80, "stream": True,
            "tools": [EXEC, PICK], "tool_choice": {"type": "custom", "name": "exec"}}) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    types = [event["type"] for event in events]
    assert "response.custom_tool_call_input.delta" in types and types[-1] == "response.completed"
    (done,) = [event for event in events if event["type"] == "response.custom_tool_call_input.done"]
    deltas = "".join(event["delta"] for event in events if event["type"] == "response.custom_tool_call_input.delta")
    assert deltas == done["input"] and LARK_INPUT.match(done["input"])
    (item,) = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert item["type"] == "custom_tool_call" and item["input"] == done["input"]


def test_a_regex_custom_tool_and_required_with_only_it(frontend: Frontend, model_id: str) -> None:
    result = post(frontend, model_id, tools=[PICK, *HOSTED], tool_choice={"type": "required"},
                  parallel_tool_calls=False)
    assert result.status_code == 200, result.text
    (call,) = result.json()["output"]
    assert call["type"] == "custom_tool_call" and call["input"] in ("yes", "no")


def test_hosted_tools_on_chat_completions_are_left_out(frontend: Frontend, model_id: str) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}},
             {"type": "web_search_preview"}]
    result = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model_id, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": {"type": "required"}, "max_tokens": 40, "temperature": 0})
    assert result.status_code == 200, result.text
    assert result.headers["X-Ignored-Tools"] == "web_search_preview"
    (call,) = result.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "f"
