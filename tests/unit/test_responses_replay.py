"""GET /v1/responses/{id}?stream=true: a stored response's events again, as OpenAI streams them
(`starting_after` resumes), through the app with a fake engine and through the openai SDK."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from http_frontend.app import create_app
from http_frontend.settings import FrontendSettings
from protocol import CallMethod
from tests.unit.fake_engine import FakeEngine, client_for, say, sse_events, stays_connected, usage
from tests.unit.test_responses_translation import collapse

TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}},
         {"type": "custom", "name": "exec", "description": "Runs code"}]


def streamed_and_stored(engine: FakeEngine, **body: Any) -> list[dict[str, Any]]:
    """The events of a streamed POST; its stored record becomes what the fake engine's store answers."""
    result = client_for(engine).simulate_post("/v1/responses", json={"model": "m", "input": "hi", "stream": True,
                                                                     **body})
    assert result.status_code == 200, result.text
    put = [args for method, args in engine.calls if method == CallMethod.RESPONSES_PUT.value][-1]
    engine.replies[CallMethod.RESPONSES_GET] = put["record"]
    return [json.loads(data) for _, data in sse_events(result.text)]


def logprob(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


def merged(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`events` with each run of one part's deltas joined into one delta, renumbered from 0."""
    out: list[dict[str, Any]] = []
    for event in events:
        last = out[-1] if out else {}
        if event["type"].endswith(".delta") and last.get("type") == event["type"] and \
                last.get("item_id") == event["item_id"]:
            out[-1] = {**last, "delta": last["delta"] + event["delta"]}
            if "logprobs" in last:
                out[-1]["logprobs"] = last["logprobs"] + event["logprobs"]
        else:
            out.append(dict(event))
    return [{**event, "sequence_number": number} for number, event in enumerate(out)]


def replayed(engine: FakeEngine, response_id: str, query: str = "stream=true") -> list[dict[str, Any]]:
    result = client_for(engine).simulate_get(f"/v1/responses/{response_id}", query_string=query)
    assert result.status_code == 200, result.text
    assert result.headers["content-type"].startswith("text/event-stream")
    events = sse_events(result.text)
    assert all(name == json.loads(data)["type"] for name, data in events)
    return [json.loads(data) for _, data in events]


def test_a_one_delta_response_replays_exactly_as_it_streamed() -> None:
    engine = FakeEngine(script=lambda request: say("Hello"))
    original = streamed_and_stored(engine)
    response_id = original[-1]["response"]["id"]
    assert replayed(engine, response_id) == original  # was a 200 JSON body, not a stream
    # Without stream (or stream=false) the stored response is JSON, as before.
    for query in ("", "stream=false"):
        result = client_for(engine).simulate_get(f"/v1/responses/{response_id}", query_string=query)
        assert result.json == original[-1]["response"]


def test_reasoning_text_and_calls_replay_in_order_one_delta_per_part() -> None:
    script = [{"reasoning": "Let me", "token_ids": [1]}, {"reasoning": " think.", "token_ids": [2]},
              {"text": "Hel", "token_ids": [3], "logprobs": [logprob("Hel")]},
              {"text": "lo", "token_ids": [4], "logprobs": [logprob("lo")]},
              {"tool_calls": [{"id": "call_0", "name": "f", "arguments": '{"a": 1}'},
                              {"id": "call_1", "name": "exec", "arguments": '{"input": "ls -l"}'}]},
              {"finish_reason": "tool_calls", "usage": usage(6)}]
    engine = FakeEngine(script=lambda request: list(script))
    original = streamed_and_stored(engine, tools=TOOLS, include=["message.output_text.logprobs"])
    events = replayed(engine, original[-1]["response"]["id"])
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [e["type"] for e in events] == collapse([e["type"] for e in original])
    assert events[-1] == {**original[-1], "sequence_number": len(events) - 1}
    deltas = {kind: "".join(e["delta"] for e in events if e["type"] == kind) for kind in
              ("response.reasoning_text.delta", "response.output_text.delta",
               "response.function_call_arguments.delta", "response.custom_tool_call_input.delta")}
    assert deltas == {"response.reasoning_text.delta": "Let me think.", "response.output_text.delta": "Hello",
                      "response.function_call_arguments.delta": '{"a": 1}',
                      "response.custom_tool_call_input.delta": "ls -l"}
    assert [lp["token"] for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]] == \
        ["Hel", "lo"]
    # Event for event, the stream with each run of deltas joined into one (ids and shapes the same).
    assert events == merged(original)


def test_starting_after_resumes_after_that_event() -> None:
    engine = FakeEngine(script=lambda request: say("Hello"))
    original = streamed_and_stored(engine)
    response_id = original[-1]["response"]["id"]
    assert replayed(engine, response_id, "stream=true&starting_after=3") == original[4:]
    assert replayed(engine, response_id, f"stream=true&starting_after={len(original) - 1}") == []


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "", "99", "9" * 400, "٣"])
def test_a_bad_starting_after_is_a_400_naming_it(value: str) -> None:
    engine = FakeEngine(script=lambda request: say("Hello"))
    response_id = streamed_and_stored(engine)[-1]["response"]["id"]
    result = client_for(engine).simulate_get(f"/v1/responses/{response_id}",
                                             query_string=f"stream=true&starting_after={value}")
    assert result.status_code == 400, result.text
    error = result.json["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "starting_after"
    assert "starting_after" in error["message"]


def test_a_failed_response_replays_its_error_and_response_failed() -> None:
    script = [{"text": "Hel", "token_ids": [1]},
              {"error": {"status": 500, "code": "engine_error", "message": "the model broke", "param": None,
                         "type": "server_error"}}]
    engine = FakeEngine(script=lambda request: list(script))
    original = streamed_and_stored(engine)
    events = replayed(engine, original[-1]["response"]["id"])
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "the model broke" and events[-1]["response"] == original[-1]["response"]


def test_the_sdk_streams_a_stored_response() -> None:
    """`client.responses.retrieve(id, stream=True)` sends `?stream=true` and parses typed events."""
    engine = FakeEngine(script=lambda request: say("Hello", " there"))
    original = streamed_and_stored(engine)
    response_id = original[-1]["response"]["id"]
    app = stays_connected(create_app(settings=FrontendSettings(), engine=engine))

    async def retrieve(**query: Any) -> list[Any]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)
        async with http:
            return [event async for event in await client.responses.retrieve(response_id, stream=True, **query)]

    events = asyncio.run(retrieve())
    assert [e.type for e in events] == collapse([e["type"] for e in original])
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello there"
    resumed = asyncio.run(retrieve(starting_after=events[-2].sequence_number))
    assert [e.model_dump() for e in resumed] == [events[-1].model_dump()]
