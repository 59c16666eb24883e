"""Anthropic Messages through the real stack: anthropic SDK -> gunicorn -> engined -> MLX.

Plus the translation and block-building pieces on their own, where a table of inputs
says more than a server round trip would. This SDK version takes sampling fields
through `extra_body` (its `create` has no `temperature`), as any client may send them.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from falcon.asgi import SSEvent

from model_builders.text import derive_model, thinking_chat_template
from http_frontend.anthropic.request import chat_messages, engine_request
from http_frontend.anthropic.stream import BlockBuilder, anthropic_sse, stop_reason
from http_frontend.engine.client import Update
from http_frontend.errors import APIError, anthropic_error_body, is_anthropic_path
from http_frontend.settings import FrontendSettings
from tests.helpers import Frontend

GREEDY = {"temperature": 0}
PROMPT = [{"role": "user", "content": "Tell me a story about a fox."}]
TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                           "required": ["city"]}}]


def client_for(frontend: Frontend) -> anthropic.Anthropic:
    # The SDK appends /v1/messages to base_url itself.
    return anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=60)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def check_grammar(events: list[Any]) -> None:
    """message_start, then per block start / delta* / stop in index order, message_delta, message_stop."""
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    index = -1
    open_block = None
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_block is None and e.index == index + 1, types
            index = open_block = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_block, types
        else:
            assert e.type == "content_block_stop" and e.index == open_block, types
            open_block = None
    assert open_block is None, types


# -- end to end ------------------------------------------------------------------------------------

def test_message_and_its_streams_agree(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    result = client.messages.create(model=model_id, max_tokens=20, messages=PROMPT, extra_body=GREEDY)
    assert result.type == "message" and result.role == "assistant" and result.id.startswith("msg_")
    assert result.model == model_id
    assert [block.type for block in result.content] == ["text"]
    assert result.stop_reason in ("end_turn", "max_tokens") and result.stop_sequence is None
    assert result.usage.output_tokens > 0 and result.usage.input_tokens + result.usage.cache_read_input_tokens > 0
    text = text_of(result)
    assert text

    events = list(client.messages.create(model=model_id, max_tokens=20, messages=PROMPT, stream=True,
                                         extra_body=GREEDY))
    check_grammar(events)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert events[-2].delta.stop_reason == result.stop_reason
    assert events[-2].usage.output_tokens == result.usage.output_tokens
    assert events[0].message.id.startswith("msg_") and events[0].message.content == []

    with client.messages.stream(model=model_id, max_tokens=20, messages=PROMPT, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text
    assert final.stop_reason == result.stop_reason


def test_raw_sse_names_every_event_and_pings(frontend: Frontend, model_id: str) -> None:
    body = {"model": model_id, "max_tokens": 6, "messages": PROMPT, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{frontend.base_url}/v1/messages", json=body, timeout=60,
                      headers={"anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = [frame for frame in raw.split("\n\n") if frame.strip()]
    names = []
    for frame in frames:
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        assert json.loads(lines["data"])["type"] == lines["event"]
        names.append(lines["event"])
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert "[DONE]" not in raw


def test_a_vanished_stream_client_frees_the_engine(frontend: Frontend, model_id: str) -> None:
    body = {"model": model_id, "max_tokens": 3000, "messages": PROMPT, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{frontend.base_url}/v1/messages", json=body, timeout=60) as response:
        lines = response.iter_lines()
        while "content_block_delta" not in next(lines):
            pass
    left = time.monotonic()
    while True:
        stats = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
        if stats["running"] == 0 and stats["queued"] == 0:
            break
        assert time.monotonic() - left < 3.0, stats
        time.sleep(0.05)


def test_max_tokens_and_stop_sequences(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    full = client.messages.create(model=model_id, max_tokens=24, messages=PROMPT, extra_body=GREEDY)
    text = text_of(full)
    assert full.usage.output_tokens > 4, "the reference output is too short to cut"
    short = client.messages.create(model=model_id, max_tokens=4, messages=PROMPT, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 4
    assert text.startswith(text_of(short))

    # A stop sequence greedy decoding is known to produce, after some text.
    stop = next(text[i:i + 3] for i in range(2, len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in
                text[i:i + 3])
    stops = ["\u0000never", stop]
    stopped = client.messages.create(model=model_id, max_tokens=24, messages=PROMPT, stop_sequences=stops,
                                     extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == text[:text.index(stop)]
    events = list(client.messages.create(model=model_id, max_tokens=24, messages=PROMPT, stop_sequences=stops,
                                         stream=True, extra_body=GREEDY))
    check_grammar(events)
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", stop)
    # Without a match the reason stays end_turn / max_tokens and stop_sequence null.
    unmatched = client.messages.create(model=model_id, max_tokens=4, messages=PROMPT,
                                       stop_sequences=["\u0000never"], extra_body=GREEDY)
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("max_tokens", None)


def test_count_tokens_matches_usage(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    request = {"model": model_id, "system": [{"type": "text", "text": "You are terse."}], "messages": PROMPT}
    counted = client.messages.count_tokens(**request).input_tokens
    result = client.messages.create(max_tokens=2, **request)
    assert counted == result.usage.input_tokens + result.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(tools=TOOLS, **request).input_tokens
    used = client.messages.create(max_tokens=2, tools=TOOLS, **request).usage
    assert with_tools > counted  # tool definitions are part of the prompt
    assert with_tools == used.input_tokens + used.cache_read_input_tokens


def test_errors_come_in_anthropic_shape(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model_id, max_tokens=8, messages=PROMPT, extra_body={"max_tokens": None})
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in caught.value.body["error"]["message"]

    url = f"{frontend.base_url}/v1/messages"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    for body in ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
                 {"max_tokens": 4, "messages": PROMPT, "temperature": 1.5},
                 {"max_tokens": 4, "messages": [{"role": "user", "content": [image]}]},
                 {"max_tokens": 4, "messages": PROMPT, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
                 {"max_tokens": 4, "messages": PROMPT, "thinking": {"type": "enabled", "budget_tokens": 4}}):
        response = httpx.post(url, json={"model": model_id, **body}, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{url}/nope", json={}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    counted = httpx.post(f"{url}/count_tokens", json={"model": model_id, "messages": []}, timeout=30)
    assert counted.status_code == 400 and counted.json()["type"] == "error"
    # OpenAI routes keep OpenAI's envelope.
    openai_error = httpx.post(f"{frontend.base_url}/v1/chat/completions", json={"model": model_id}, timeout=30)
    assert openai_error.status_code == 400 and openai_error.json()["error"]["param"] == "messages"


def test_tool_use_round_trip(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    ask = {"model": model_id, "max_tokens": 60, "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "extra_body": GREEDY}
    result = client.messages.create(**ask)
    assert result.stop_reason == "tool_use", result
    calls = [block for block in result.content if block.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and calls[0].input.get("city") in ("Paris", "Rome")
    assert calls[0].id and not text_of(result).strip()

    events = list(client.messages.create(stream=True, **ask))
    check_grammar(events)
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(c.name, c.input) for c in calls]

    single = client.messages.create(**{**ask, "tool_choice": {"type": "tool", "name": "get_weather",
                                                              "disable_parallel_tool_use": True}})
    assert [block.type for block in single.content] == ["tool_use"] and single.stop_reason == "tool_use"

    answer = client.messages.create(
        model=model_id, max_tokens=8, tools=TOOLS, extra_body=GREEDY,
        messages=[*ask["messages"], {"role": "assistant", "content": [b.model_dump() for b in result.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                "content": [{"type": "text", "text": "18 C and sunny"}]}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.output_tokens > 0


@pytest.fixture(scope="module")
def thinking_model(tiny_model: Path) -> str:
    # Next to the tiny model: the engine serves paths under its --model's directory.
    return str(derive_model(tiny_model, tiny_model.parent / "tiny-thinking-messages", thinking_chat_template()))


def test_thinking_blocks(frontend: Frontend, thinking_model: str) -> None:
    client = client_for(frontend)
    ask = {"model": thinking_model, "max_tokens": 12, "messages": PROMPT,
           "thinking": {"type": "enabled", "budget_tokens": 4}, "extra_body": {**GREEDY, "ignore_eos": True}}
    result = client.messages.create(**ask)
    assert [block.type for block in result.content] == ["thinking", "text"]
    assert result.content[0].thinking and result.content[0].signature == "" and result.content[1].text
    assert "think>" not in result.content[0].thinking + result.content[1].text
    events = list(client.messages.create(stream=True, **ask))
    check_grammar(events)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == result.content[0].thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == result.content[1].text

    off = client.messages.create(**{**ask, "thinking": {"type": "disabled"}})
    assert [block.type for block in off.content] == ["text"]


# -- translation and rendering ----------------------------------------------------------------------

def translate(**body: Any) -> dict[str, Any]:
    return engine_request({"max_tokens": 16, **body}, FrontendSettings())


def test_blocks_become_chat_messages() -> None:
    request = translate(
        model="m", system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        stop_sequences=["END"], top_k=5, tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 8},
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Paris."}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                {"type": "text", "text": "And tomorrow?"}]},
        ])
    assert request["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?\nParis."},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert request["params"] == {"max_tokens": 16, "top_k": 5, "stop": ["END"], "thinking_budget": 8}
    assert request["chat_template_kwargs"] == {"enable_thinking": True}
    assert request["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city", "parameters": TOOLS[0]["input_schema"]}}]
    assert request["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert request["parallel_tool_calls"] is False
    assert translate(messages=PROMPT, tools=TOOLS, tool_choice={"type": "any"})["tool_choice"] == "required"
    assert translate(messages=PROMPT, thinking={"type": "disabled"})["chat_template_kwargs"] == \
        {"enable_thinking": False}
    assert translate(messages=PROMPT, output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}
                     )["response_format"]["json_schema"]["schema"] == {"type": "object"}


def test_image_blocks_become_image_url_parts() -> None:
    messages = chat_messages({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}]}]})
    assert messages == [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}]}]


@pytest.mark.parametrize("body", [
    {"messages": PROMPT, "max_tokens": None},
    {"messages": PROMPT, "max_tokens": 0},
    {"messages": []},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
    {"messages": [*PROMPT, {"role": "assistant", "content": "Once upon"}]},
    {"messages": PROMPT, "stop_sequences": "END"},
    {"messages": PROMPT, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"messages": PROMPT, "tools": [{"name": "f"}]},
    {"messages": PROMPT, "tool_choice": {"type": "any"}},
    {"messages": PROMPT, "tool_choice": {"type": "sometimes"}, "tools": TOOLS},
    {"messages": PROMPT, "thinking": {"type": "enabled"}},
    {"messages": PROMPT, "thinking": {"type": "enabled", "budget_tokens": 16}},
    {"messages": PROMPT, "mcp_servers": [{"url": "https://example.com"}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
])
def test_bad_requests_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(APIError) as caught:
        engine_request({"max_tokens": 16, **body}, FrontendSettings())
    assert caught.value.status == 400


def test_block_builder_orders_and_closes_blocks() -> None:
    builder = BlockBuilder()
    events = builder.feed(Update(reasoning="Hm"))
    events += builder.feed(Update(reasoning=".", text="Hi"))
    events += builder.feed(Update(text="!", tool_calls=[{"index": 0, "id": "call_1", "name": "f",
                                                         "arguments": '{"a": 1}'}]))
    events += builder.finish()
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
        ("content_block_delta", 2), ("content_block_stop", 2)]
    assert events[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert builder.blocks == [{"type": "thinking", "thinking": "Hm.", "signature": ""},
                              {"type": "text", "text": "Hi!"},
                              {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}]
    assert events[-2]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert stop_reason("stop", None, builder.has_tool_use) == ("tool_use", None)
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("length", None, False) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, True) == ("tool_use", None)


def test_whitespace_alone_opens_no_text_block() -> None:
    builder = BlockBuilder()
    events = builder.feed(Update(text="\n"))
    assert events == []
    events = builder.feed(Update(tool_calls=[{"index": 0, "id": "call_1", "name": "f", "arguments": "{}"}]))
    events += builder.feed(Update(text=" \n"))
    events += builder.finish()
    assert builder.blocks == [{"type": "tool_use", "id": "call_1", "name": "f", "input": {}}]
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta", "content_block_stop"]
    # Leading whitespace still reaches the text once some text follows it.
    later = BlockBuilder()
    later.feed(Update(text="\n\n"))
    later.feed(Update(text="Hi"))
    assert later.blocks == [{"type": "text", "text": "\n\nHi"}]


def test_keepalives_and_errors_become_anthropic_events() -> None:
    closed = []

    async def inner():
        try:
            yield SSEvent(event="message_start", json={"type": "message_start"})
            yield None
            yield SSEvent(json={"error": {"message": "The engine restarted", "type": "server_error",
                                          "code": "engine_restarted", "param": None}})
            yield SSEvent(event="never", json={"type": "never"})
        finally:
            closed.append(True)

    async def first_four() -> list[SSEvent]:
        outer = anthropic_sse(inner())
        events = [await outer.__anext__() for _ in range(4)]
        await outer.aclose()  # as falcon does when the client leaves
        return events

    events = asyncio.run(first_four())
    assert [e.event for e in events] == ["message_start", "ping", "ping", "error"]
    assert events[3].json == {"type": "error", "error": {"type": "overloaded_error",
                                                         "message": "The engine restarted"}}
    assert closed == [True]


def test_error_envelope_switches_on_the_path() -> None:
    assert all(is_anthropic_path(p) for p in ("/v1/messages", "/messages", "/v1/messages/count_tokens"))
    assert not any(is_anthropic_path(p) for p in ("/v1/messagesx", "/v1/chat/completions", "/v1/responses"))
    kinds = {status: anthropic_error_body(APIError(status, "m"))["error"]["type"]
             for status in (400, 401, 404, 413, 429, 500, 503, 504)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                     413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                     504: "timeout_error"}
