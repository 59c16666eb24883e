"""`tool_choice: allowed_tools` (Chat Completions and Responses): the model calls only the allowed tools.

Red team: Responses kept the mode and dropped the list (8 of 8 seeds called the tool that was not
allowed), and Chat Completions refused the documented shape with a 400. Mode "required" keeps every
tool in the prompt and forces a call among the allowed ones; mode "auto" describes only those.
"""

from __future__ import annotations

import json

import httpx

from tests.helpers import Frontend, client_for


def _tool(name: str, key: str, value: str) -> dict:
    return {"name": name, "parameters": {"type": "object", "properties": {key: {"type": "string", "enum": [value]}},
                                         "required": [key], "additionalProperties": False}}


CHAT_TOOLS = [{"type": "function", "function": _tool("a", "x", "1")},
              {"type": "function", "function": _tool("b", "y", "2")}]
RESPONSES_TOOLS = [{"type": "function", **_tool("a", "x", "1")}, {"type": "function", **_tool("b", "y", "2")}]
ONLY_B = {"type": "allowed_tools", "allowed_tools": {"mode": "required",
                                                      "tools": [{"type": "function", "function": {"name": "b"}}]}}


def test_chat_calls_only_the_allowed_tools(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    calls = []
    for seed in range(4):  # sampled: without the constraint the random model picks "a" as often as "b"
        reply = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": f"go {seed}"}], tools=CHAT_TOOLS, max_tokens=40,
            temperature=1.0, seed=seed, parallel_tool_calls=False, tool_choice=ONLY_B)
        assert reply.choices[0].finish_reason == "tool_calls", reply
        calls += [(call.function.name, json.loads(call.function.arguments))
                  for call in reply.choices[0].message.tool_calls]
    assert calls == [("b", {"y": "2"})] * 4
    chunks = list(client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "go"}], tools=CHAT_TOOLS, max_tokens=40, stream=True,
        temperature=1.0, seed=9, parallel_tool_calls=False, tool_choice=ONLY_B))
    assert {tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()
            if tc.function.name} == {"b"}


def test_responses_call_only_the_allowed_tools(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    names = []
    for seed in range(4):
        response = client.responses.create(
            model=model_id, input=f"go {seed}", tools=RESPONSES_TOOLS, max_output_tokens=40, parallel_tool_calls=False,
            tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]},
            extra_body={"seed": seed})
        names += [item.name for item in response.output if item.type == "function_call"]
    assert names == ["b"] * 4


def test_auto_describes_only_the_allowed_tools(frontend: Frontend, model_id: str) -> None:
    """Mode "auto" cannot force anything, so the prompt offers only the allowed tools (same prompt as listing them)."""
    url = f"{frontend.base_url}/v1/chat/completions"
    base = {"model": model_id, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1}

    def prompt_tokens(**fields: object) -> int:
        response = httpx.post(url, json={**base, **fields}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    auto_b = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ONLY_B["allowed_tools"]["tools"]}}
    narrowed = prompt_tokens(tools=CHAT_TOOLS, tool_choice=auto_b)
    assert narrowed == prompt_tokens(tools=CHAT_TOOLS[1:])
    assert narrowed < prompt_tokens(tools=CHAT_TOOLS)
    assert prompt_tokens(tools=CHAT_TOOLS, tool_choice=ONLY_B) == prompt_tokens(tools=CHAT_TOOLS)  # whole list


def test_bad_allowed_tools_are_400(frontend: Frontend, model_id: str) -> None:
    base = {"model": model_id, "messages": [{"role": "user", "content": "go"}], "max_tokens": 4, "tools": CHAT_TOOLS}
    cases = [
        ({"mode": "required", "tools": [{"type": "function", "function": {"name": "nope"}}]},
         "tool_choice.allowed_tools.tools[0]"),
        ({"mode": "required", "tools": []}, "tool_choice.allowed_tools"),
        ({"mode": "sometimes", "tools": []}, "tool_choice.allowed_tools"),
    ]
    for spec, param in cases:
        response = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60,
                              json={**base, "tool_choice": {"type": "allowed_tools", "allowed_tools": spec}})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    response = httpx.post(f"{frontend.base_url}/v1/responses", timeout=60, json={
        "model": model_id, "input": "go", "tools": RESPONSES_TOOLS,
        "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "zz"}]}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice.tools[0]", response.text
