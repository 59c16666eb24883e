"""The Responses API's items, stream builder and store, without processes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from engine_daemon.calls import response_store as store_calls
from engine_daemon.calls.response_store import ResponseStore
from engine_daemon.errors import RequestError
from http_frontend.engine.client import Update
from http_frontend.errors import APIError
from http_frontend.openai.responses import parse_request
from http_frontend.openai.responses_items import parse_input
from http_frontend.openai.responses_stream import ResponseBuilder
from http_frontend.parsing.media import MediaCollector
from http_frontend.settings import FrontendSettings
from tests.helpers import data_url, png

TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event folded into one."""
    folded: list[str] = []
    for kind in types:
        if not (kind.endswith(".delta") and folded and folded[-1] == kind):
            folded.append(kind)
    return folded


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_expires_records_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(ttl=60, max_bytes=1 << 20, clock=clock)
    assert store.put("resp_a", {"messages": [{"role": "user", "content": "hi"}]})
    clock.now += 30
    assert store.put("resp_b", {"messages": []})
    assert store.get("resp_a") == {"messages": [{"role": "user", "content": "hi"}]}
    clock.now += 31  # a is 61 s old, b 31 s
    assert store.get("resp_a") is None and store.get("resp_b") is not None
    assert store.delete("resp_a") is False
    clock.now += 30
    assert store.stats()["responses_stored"] == 0 and store.bytes == 0


def test_store_evicts_the_oldest_past_its_byte_cap() -> None:
    record = {"messages": [{"role": "user", "content": "x" * 1000}]}
    store = ResponseStore(ttl=3600, max_bytes=3500)
    for name in "abc":
        assert store.put(f"resp_{name}", record)
    assert len(store) == 3 and store.bytes <= 3500
    assert store.put("resp_d", record)
    assert store.get("resp_a") is None and store.get("resp_d") is not None
    assert [store.get(f"resp_{n}") is not None for n in "bcd"] == [True] * 3
    assert store.evicted == 1 and store.bytes <= 3500
    # Replacing a record frees the old one's bytes; one larger than the cap is refused, nothing evicted.
    assert store.put("resp_b", {"messages": []}) and len(store) == 3
    assert not store.put("resp_huge", {"blob": "y" * 4000})
    assert store.get("resp_huge") is None and len(store) == 3
    assert store.delete("resp_c") is True and store.get("resp_c") is None


def test_store_calls_check_their_arguments() -> None:
    store = ResponseStore()
    assert store_calls.put(store, {"id": "resp_1", "record": {"response": {}}}) == {"stored": True}
    assert store_calls.get(store, {"id": "resp_1"}) == {"response": {}}
    assert store_calls.get(store, {"id": "resp_2"}) is None
    assert store_calls.delete(store, {"id": "resp_1"}) == {"deleted": True}
    for call, args in [(store_calls.get, {}), (store_calls.get, {"id": 7}), (store_calls.get, {"id": "x" * 300}),
                       (store_calls.put, {"id": "resp_1", "record": [1]})]:
        with pytest.raises(RequestError) as caught:
            call(store, args)
        assert caught.value.status == 400 and caught.value.code == "invalid_value"


def test_input_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"unit\": \"C\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 18 C."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And this? "},
                                     {"type": "input_image", "image_url": data_url(png(1, 56)), "detail": "auto"}]},
    ]
    media = MediaCollector(FrontendSettings())
    messages = parse_input(items, 100, media)
    # The image leaves a placeholder where it was; its bytes go to the ADD's `media`.
    assert len(media) == 1 and messages[-1]["content"].startswith("And this? <|media:")
    placeholder = messages[-1]["content"][len("And this? "):]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"unit\": \"C\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C."},
        {"role": "user", "content": "And this? " + placeholder},
    ]
    assert parse_input("hi", 1) == [{"role": "user", "content": "hi"}]
    # Without a collector (as in function_call_output), and in a system message, images are refused.
    with pytest.raises(APIError) as refused:
        parse_input([items[-1]], 100)
    assert refused.value.param == "input[0].content[1].type"
    with pytest.raises(APIError) as refused:
        parse_input([{**items[-1], "role": "system"}], 100, MediaCollector(FrontendSettings()))
    assert refused.value.param == "input[0].content[1]"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


FIELDS = ["input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens", "temperature",
          "previous_response_id", "store", "stream", "metadata", "parallel_tool_calls"]


ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]) | JSON,
    "role": st.sampled_from(["user", "assistant", "system", "developer"]) | JSON,
    "content": JSON | st.lists(st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"]) | JSON,
        "text": JSON, "image_url": JSON, "refusal": JSON}), max_size=3),
    "call_id": JSON, "name": JSON, "arguments": JSON, "output": JSON})


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), st.lists(ITEM, max_size=4))
def test_any_body_is_parsed_or_refused_with_a_400(body: dict[str, Any], items: list[dict[str, Any]]) -> None:
    """Fuzzed fields never raise anything but a 400 naming a param (a 500 would be a bug)."""
    for candidate in (body, {**body, "input": items}):
        try:
            request = parse_request(candidate, max_items=16, max_tokens_limit=None,
                                    media=MediaCollector(FrontendSettings()))
        except APIError as exc:
            assert exc.status == 400 and exc.param, (candidate, exc.message)
        else:
            assert all(isinstance(m, dict) and m["role"] in ("system", "user", "assistant", "tool")
                       for m in request.messages)


def test_builder_events_match_the_sdk_types() -> None:
    """Reasoning, text and a tool call in one response: each event validates as the SDK's own type."""
    from openai.types.responses import Response, ResponseStreamEvent

    builder = ResponseBuilder({"id": "resp_1", "object": "response", "created_at": 1, "model": "m",
                               "parallel_tool_calls": True, "tool_choice": "auto", "tools": []})
    events = builder.start()
    events += builder.feed(Update(reasoning="Let me think."))
    events += builder.feed(Update(reasoning=" Done.", text="Hello"))
    events += builder.feed(Update(text=" there", tool_calls=[
        {"index": 0, "id": "call_9", "name": "get_weather", "arguments": "{\"unit\": \"C\"}"}]))
    events += builder.feed(Update(finish_reason="tool_calls", usage={
        "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "cached_tokens": 2}))
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        assert adapter.validate_python(json.loads(json.dumps(event))).type == event["type"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert collapse([e["type"] for e in events]) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        *TEXT_EVENTS, *TEXT_DONE,
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Let me think. Done."
    assert final.output_text == "Hello there" and final.output[2].call_id == "call_9"
    assert final.usage.input_tokens_details.cached_tokens == 2 and final.status == "completed"
    assert builder.assistant_message() == {
        "role": "assistant", "content": "Hello there", "reasoning_content": "Let me think. Done.",
        "tool_calls": [{"id": "call_9", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"unit\": \"C\"}"}}]}
    # An immediate end of generation still answers one (empty) assistant message.
    empty = ResponseBuilder(dict(builder.base))
    events = empty.start() + empty.feed(Update(finish_reason="stop", usage={
        "prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.output_item.added", "response.content_part.added",
                                           *TEXT_DONE, "response.completed"]
    assert Response.model_validate(events[-1]["response"]).output_text == ""
    failed = ResponseBuilder(dict(builder.base))
    failed.start()
    error, failure = failed.fail(APIError(503, "The engine restarted", code="engine_restarted"))
    assert adapter.validate_python(error).type == "error" and failure["response"]["status"] == "failed"
