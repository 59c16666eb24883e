"""Anthropic Messages <-> the engine's chat shapes, without processes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from falcon.asgi import SSEvent

from http_frontend.anthropic.request import chat_messages, engine_request
from http_frontend.anthropic.stream import BlockBuilder, anthropic_sse, stop_reason
from http_frontend.engine.client import Update
from http_frontend.errors import APIError, anthropic_error_body, is_anthropic_path
from http_frontend.parsing.media import SOURCE_PARAM, MediaCollector
from http_frontend.settings import FrontendSettings

PROMPT = [{"role": "user", "content": "Tell me a story about a fox."}]


TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                           "required": ["city"]}}]


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
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, SOURCE_PARAM: "messages.0.content.1"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"},
         SOURCE_PARAM: "messages.0.content.2"}]}]


def test_an_image_error_names_the_block_as_the_client_sent_it() -> None:
    """A system prompt and tool results shift the translated messages: the error still names Anthropic's block."""
    body = {"model": "m", "max_tokens": 8, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                                     {"type": "text", "text": "And this?"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": "bm90IGFuIGltYWdl"}}]}]}
    settings = FrontendSettings()
    with pytest.raises(APIError) as info:
        engine_request(body, settings, media=MediaCollector.for_request(body, settings))
    assert info.value.param == "messages.2.content.2", info.value.param
    assert "'messages.2.content.2'" in info.value.message, info.value.message


@pytest.mark.parametrize("body", [
    {"messages": PROMPT, "max_tokens": None},
    {"messages": PROMPT, "max_tokens": 0},
    {"messages": []},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
    {"messages": [*PROMPT, {"role": "assistant", "content": "Once upon"}]},
    {"messages": PROMPT, "stop_sequences": "END"},
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


def test_claude_codes_tool_search_and_tool_changes_are_read_not_refused() -> None:
    """Red team with Claude Code: a `tool_reference` in a tool_result got 400 three times and Claude Code turned
    tool search off; `tool_addition` / `tool_removal` in a system turn got a 400 naming `system.0`."""
    messages = chat_messages({"messages": [
        {"role": "user", "content": "Find a tool"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": "select:WebFetch"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "tool_reference", "tool_name": "WebFetch"}]}]},
        {"role": "system", "content": [
            {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
                "name": "mcp__db__query", "description": "Run SQL.", "input_schema": {"type": "object"}}}},
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Read"}}]},
        {"role": "user", "content": "Go on"}]})
    tool_turn = next(turn for turn in messages if turn["role"] == "tool")
    assert "WebFetch" in tool_turn["content"]
    note = next(turn for turn in messages if turn["role"] == "system")["content"]
    assert "mcp__db__query" in note and "Run SQL." in note and "Read is no longer available" in note
    with pytest.raises(APIError) as info:  # anything else in a system turn is still refused, named where it is
        chat_messages({"messages": [{"role": "user", "content": "hi"},
                                    {"role": "system", "content": [{"type": "image", "source": {}}]},
                                    {"role": "user", "content": "hi"}]})
    assert info.value.param == "messages.1.content.0"
