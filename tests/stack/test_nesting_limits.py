"""Fuzzing's unhelpful 400s through the real stack: an escaped lone surrogate in tool-call arguments reached the
tokenizer ("TextEncodeInput must be Union[...]"), and arguments nested 100,000 deep the template ("maximum
recursion depth exceeded"). The front-end now names them; what it lets through, the real template renders."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.helpers import Frontend, error_of

DEPTH = 256  # `MAX_NESTING`: the deepest the front-end takes, which the template rendered (it failed from ~500)


def chat(model_id: str, arguments: str) -> dict[str, Any]:
    return {"model": model_id, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


def test_tool_call_arguments_are_refused_by_name_or_rendered(frontend: Frontend, model_id: str) -> None:
    url = f"{frontend.base_url}/v1/chat/completions"
    param = "messages.[1].tool_calls.[0].function.arguments"
    lone = error_of(httpx.post(url, json=chat(model_id, '{"a": "\\ud800"}'), timeout=60))
    assert lone["param"] == param and "lone UTF-16 surrogate" in lone["message"]
    deep = error_of(httpx.post(url, json=chat(model_id, "[" * 100_000 + "]" * 100_000), timeout=60))
    assert deep["param"] == param and f"more than {DEPTH} levels deep" in deep["message"]
    at_limit = httpx.post(url, json=chat(model_id, '{"a": ' + "[" * (DEPTH - 1) + "]" * (DEPTH - 1) + "}"),
                          timeout=60)
    assert at_limit.status_code == 200, at_limit.text


def test_anthropic_tool_use_input_at_the_limit_renders(frontend: Frontend, model_id: str) -> None:
    body = {"model": model_id, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": "X"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}
    inner = DEPTH - 6  # the body, messages, the turn, its content, the block and `input` hold `a`
    raw = json.dumps(body).replace('"X"', "[" * inner + "]" * inner)
    answer = httpx.post(f"{frontend.base_url}/v1/messages", content=raw, timeout=60,
                        headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    raw = json.dumps(body).replace('"X"', "[" * (inner + 1) + "]" * (inner + 1))
    refused = httpx.post(f"{frontend.base_url}/v1/messages", content=raw, timeout=60,
                         headers={"content-type": "application/json"})
    assert refused.status_code == 400 and "messages.[1].content.[0].input.a" in refused.json()["error"]["message"]
