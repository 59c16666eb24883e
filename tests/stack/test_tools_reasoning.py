"""Reasoning and tool calls through the real stack (openai SDK -> gunicorn -> engined).

A thinking variant of the tiny model (same weights, a template whose generation
prompt opens `<think>`) makes reasoning deterministic: random weights never close
the block themselves, so everything is reasoning unless `thinking_budget` closes
it or `enable_thinking: false` renders it closed.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from model_builders.text import derive_model
from model_builders.tokenizer import thinking_chat_template
from tests.helpers import Frontend, client_for

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def thinking_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    # Next to the tiny model: the engine serves paths under its --model's directory.
    return str(derive_model(tiny_model, tiny_model.parent / "tiny-thinking", thinking_chat_template()))


def ask(client: openai.OpenAI, model: str, **extra: object):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is 7 prime?"}],
                                          temperature=0, **extra)


def streamed(client: openai.OpenAI, model: str, **extra: object) -> tuple[str, str, str, list]:
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is 7 prime?"}], temperature=0, stream=True, **extra))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content, reasoning, finish[-1], chunks


def test_open_thinking_block_goes_to_reasoning(frontend: Frontend, thinking_model: str) -> None:
    client = client_for(frontend)
    result = ask(client, thinking_model, max_tokens=12, extra_body={"ignore_eos": True})
    message = result.choices[0].message
    assert message.reasoning_content and message.reasoning == message.reasoning_content
    assert not message.content  # the block never closed: no answer text
    assert "<think>" not in message.reasoning_content and "</think>" not in message.reasoning_content
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens_details.reasoning_tokens == result.usage.completion_tokens == 12


def test_thinking_budget_closes_the_block_then_answers(frontend: Frontend, thinking_model: str) -> None:
    client = client_for(frontend)
    extra = {"extra_body": {"thinking_budget": 4, "ignore_eos": True}, "max_tokens": 16, "logprobs": True}
    result = ask(client, thinking_model, **extra)
    message = result.choices[0].message
    assert message.reasoning_content and message.content
    assert "think>" not in message.content and "think>" not in message.reasoning_content
    # 4 thinking tokens + the forced </think> + 11 answer tokens = 16
    assert result.usage.completion_tokens == 16
    assert result.usage.completion_tokens_details.reasoning_tokens == 5
    # The per-token logprobs show where the block closed: right after the 4 budgeted tokens.
    assert [entry.token for entry in result.choices[0].logprobs.content].index("</think>") == 4
    content, reasoning, finish, _ = streamed(client, thinking_model, **extra)
    assert (content, reasoning) == (message.content, message.reasoning_content)
    assert finish == result.choices[0].finish_reason


def test_enable_thinking_false_is_honoured(frontend: Frontend, thinking_model: str) -> None:
    client = client_for(frontend)
    for extra in ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        result = ask(client, thinking_model, max_tokens=8, extra_body={**extra, "ignore_eos": True})
        message = result.choices[0].message
        assert message.content and not getattr(message, "reasoning_content", None)
    result = ask(client, thinking_model, max_tokens=8, reasoning_effort="none", extra_body={"ignore_eos": True})
    assert result.choices[0].message.content and not getattr(result.choices[0].message, "reasoning_content", None)


def test_tool_messages_render_through_the_template(frontend: Frontend, model_id: str) -> None:
    """A multi-turn with an assistant tool call and a tool result reaches the model as the template means."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    result = client_for(frontend).chat.completions.create(model=model_id, messages=messages, tools=TOOLS,
                                                          max_tokens=4, temperature=0)
    assert result.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Tokenization uses the loaded model (the chat request above loaded it).
    tokens = httpx.post(f"{frontend.base_url}/tokenize", json={"model": model_id, "messages": messages}).json()
    prompt = httpx.post(f"{frontend.base_url}/detokenize", json={"model": model_id,
                                                                 "tokens": tokens["tokens"]}).json()["prompt"]
    # Arguments are rendered as a JSON object, not a JSON-encoded string.
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt


def test_tool_fields_are_validated(frontend: Frontend, model_id: str) -> None:
    base = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"thinking_budget": -1}, "thinking_budget"),
        ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages.[0].tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]
    for extra, param in cases:
        response = httpx.post(f"{frontend.base_url}/v1/chat/completions", json={**base, **extra}, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, (extra, response.json())


def _forced_call(client: openai.OpenAI, model: str, stream: bool, **extra: object):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # One call: random weights would otherwise keep appending parallel calls until max_tokens.
    return client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=120,
                                          temperature=0, stream=stream, parallel_tool_calls=False, **extra)


def test_forced_tool_call_round_trip(frontend: Frontend, model_id: str) -> None:
    """tool_choice=required: a parsed call, no markup in content, stream == non-stream, then the result turn."""
    client = client_for(frontend)
    result = _forced_call(client, model_id, False, tool_choice="required")
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    (call,) = choice.message.tool_calls[:1]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments.get("city"), str)

    chunks = list(_forced_call(client, model_id, True, tool_choice="required"))
    streamed_calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # The call streams as OpenAI's does: id, type and name first, then its arguments in pieces.
    first = streamed_calls[0]
    assert first.id.startswith("call_") and first.type == "function" and first.function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in streamed_calls[1:]) and len(streamed_calls) > 2
    assert {tc.index for tc in streamed_calls} == {0}
    assert "".join(tc.function.arguments or "" for tc in streamed_calls) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    named = _forced_call(client, model_id, False,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"

    follow_up = client.chat.completions.create(
        model=model_id, tools=TOOLS, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18 C"}],
        tool_choice="none")
    assert follow_up.choices[0].finish_reason in ("stop", "length")
    assert not follow_up.choices[0].message.tool_calls
