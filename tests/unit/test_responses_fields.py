"""Responses fields OpenAI gives a meaning to: `truncation`, `max_tool_calls`, call outputs that answer no
call, failed responses in the store, a response cut before anything whole (front-end, fake engine)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import CallMethod
from tests.unit.fake_engine import FakeEngine, client_for, error_body, sse_events, usage

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "42"}


def post(engine: FakeEngine, **body: Any):
    return client_for(engine).simulate_post("/v1/responses", json={"model": "m", "input": "hi", **body})


@pytest.mark.parametrize("asked,sent", [("auto", "truncate"), ("disabled", "error"), (None, None)])
def test_truncation_picks_the_requests_overflow_mode_and_is_echoed(asked: str | None, sent: str | None) -> None:
    engine = FakeEngine()
    result = post(engine, truncation=asked)
    assert result.status_code == 200, result.text
    assert engine.added[-1].get("context_overflow") == sent
    assert result.json["truncation"] == (asked or "disabled")


def test_truncation_echoes_auto_when_older_items_made_way() -> None:
    engine = FakeEngine()  # no `truncation` asked: the model's context_overflow setting dropped turns
    engine.accepted_extra = {"context_overflow": {"mode": "truncated", "dropped_messages": 4}}
    result = post(engine)
    assert result.json["truncation"] == "auto" and result.headers["X-Context-Overflow"] == "truncated"
    streamed = post(engine, stream=True)
    final = json.loads(sse_events(streamed.text)[-1][1])["response"]
    assert final["truncation"] == "auto"


@pytest.mark.parametrize("value", ["middle", 1, True, "", ["auto"], {"type": "auto"}])  # unhashable ones: 500 before
def test_an_unknown_truncation_is_a_400_naming_it(value: Any) -> None:
    result = post(FakeEngine(), truncation=value)
    assert result.status_code == 400 and result.json["error"]["param"] == "truncation"


@pytest.mark.parametrize("engine_param,param", [("messages", "input"), ("max_tokens", "max_output_tokens")])
def test_context_length_refusals_name_the_responses_field(engine_param: str, param: str) -> None:
    engine = FakeEngine()
    engine.refusal = error_body(400, "context_length_exceeded", "too long", param=engine_param)
    result = post(engine, truncation="disabled")
    assert result.status_code == 400
    assert result.json["error"]["code"] == "context_length_exceeded" and result.json["error"]["param"] == param


def test_max_tool_calls_is_checked_and_echoed() -> None:
    assert post(FakeEngine(), max_tool_calls=3).json["max_tool_calls"] == 3
    assert post(FakeEngine()).json["max_tool_calls"] is None
    for bad in (-3, 0, "x", 1.5):
        result = post(FakeEngine(), max_tool_calls=bad)
        assert result.status_code == 400 and result.json["error"]["param"] == "max_tool_calls", bad


def test_a_call_output_answering_no_call_is_refused_as_openai_does() -> None:
    engine = FakeEngine()
    result = post(engine, input=[{"role": "user", "content": "hi"}, OUTPUT])
    assert result.status_code == 400 and not engine.added
    assert result.json["error"] == {"message": "No tool call found for function call output with call_id call_1.",
                                    "type": "invalid_request_error", "param": "input", "code": None}
    assert post(engine, input=[{"role": "user", "content": "hi"}, CALL, OUTPUT]).status_code == 200
    tool = engine.added[-1]["messages"][-1]
    assert (tool["role"], tool["tool_call_id"], tool["name"]) == ("tool", "call_1", "f")
    # Its call may be an item stored at OpenAI (`item_reference`), which OpenAI resolves and this server cannot.
    reference = {"type": "item_reference", "id": "fc_stored"}
    assert post(engine, input=[{"role": "user", "content": "hi"}, reference, OUTPUT]).status_code == 200


@pytest.mark.parametrize("part", [{"type": ["input_image"]}, {"type": {}}, {"type": None}])
def test_a_call_output_part_with_a_non_string_type_is_a_400_naming_it(part: dict[str, Any]) -> None:
    result = post(FakeEngine(), input=[CALL, {**OUTPUT, "output": [part]}])  # a list type was unhashable: 500
    assert result.status_code == 400, result.text
    assert result.json["error"]["param"] == "input[1].output[0].type"


def test_a_call_output_may_answer_a_call_of_the_previous_response() -> None:
    engine = FakeEngine()
    engine.replies[CallMethod.RESPONSES_GET] = {"owner": None, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}
    assert post(engine, input=[OUTPUT], previous_response_id="resp_1").status_code == 200
    assert post(engine, input=[{**OUTPUT, "call_id": "call_2"}], previous_response_id="resp_1").status_code == 400


def test_a_failed_response_is_stored_and_resumes_from_what_it_wrote() -> None:
    script = [{"text": "Hel", "token_ids": [1]},
              {"error": error_body(500, "engine_error", "the model broke", error_type="server_error")}]
    engine = FakeEngine(script=lambda request: list(script))
    events = sse_events(post(engine, stream=True).text)
    assert events[-1][0] == "response.failed"
    (put,) = [args for method, args in engine.calls if method == CallMethod.RESPONSES_PUT.value]
    record = put["record"]
    assert record["response"]["status"] == "failed" and record["response"]["error"]["message"] == "the model broke"
    assert record["messages"][-1] == {"role": "assistant", "content": "Hel"}


def test_a_forced_call_cut_before_its_name_has_no_item() -> None:
    engine = FakeEngine(script=lambda request: [{"finish_reason": "length", "usage": usage(6)}])
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    for stream in (False, True):
        result = post(engine, tools=tools, tool_choice={"type": "function", "name": "f"}, max_output_tokens=6,
                      stream=stream)
        response = json.loads(sse_events(result.text)[-1][1])["response"] if stream else result.json
        assert response["status"] == "incomplete" and response["output"] == []
    # A model that ends at once still answers one empty message, as OpenAI does.
    engine.script = lambda request: [{"finish_reason": "stop", "usage": usage(0)}]
    (message,) = post(engine).json["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == ""
