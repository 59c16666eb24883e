"""The generation routes in-process: `create_app` around a `FakeEngine`, driven by falcon.testing.

Validation, error envelopes, auth and the relay of scripted engine output, without
an engine, a gunicorn or a socket. What needs a real model (the text itself, tool
parsing, templates) stays in the stack tests.
"""

from __future__ import annotations

import json

import pytest

from http_frontend.engine.client import EngineLink
from http_frontend.settings import FrontendSettings
from tests.unit.fake_engine import MODEL, FakeEngine, client_for, error_body, say, sse_events

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def openai_error(result, status: int, code: str | None, param: str | None = None) -> dict:
    """The OpenAI envelope: exactly message, type, param and code."""
    assert result.status_code == status, result.text
    assert set(result.json) == {"error"}
    error = result.json["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["code"], error["param"]) == (code, param)
    return error


def anthropic_error(result, status: int, kind: str) -> dict:
    """Anthropic's envelope: {"type": "error", "error": {"type", "message"}}."""
    assert result.status_code == status, result.text
    assert result.json["type"] == "error" and set(result.json["error"]) == {"type", "message"}
    assert result.json["error"]["type"] == kind and result.json["error"]["message"]
    return result.json["error"]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


# -- the app and its fake ------------------------------------------------------------------
def test_fake_engine_has_the_interface_the_app_uses(engine: FakeEngine) -> None:
    assert isinstance(engine, EngineLink)


def test_lifespan_starts_and_closes_the_injected_client(engine: FakeEngine) -> None:
    client_for(engine).simulate_get("/health")
    assert (engine.started, engine.closed) == (1, 1)


# -- request bodies -------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]"])
def test_a_body_that_is_not_a_json_object_is_400(engine: FakeEngine, raw: bytes) -> None:
    result = client_for(engine).simulate_post(CHAT, body=raw, headers={"content-type": "application/json"})
    error = openai_error(result, 400, "invalid_json")
    assert error["type"] == "invalid_request_error"
    assert engine.added == []


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"model": MODEL}, "missing_required_parameter", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_value", "messages.[0].role"),
    ({"messages": [{"role": "user", "content": 7}]}, "invalid_type", "messages.[0].content"),
    ({"messages": HELLO, "temperature": 2.5}, "invalid_value", "temperature"),
    ({"messages": HELLO, "max_tokens": "ten"}, "invalid_type", "max_tokens"),
    ({"messages": HELLO, "n": 17}, "invalid_value", "n"),
    ({"messages": HELLO, "stop": ["s"] * 17}, "invalid_value", "stop"),
    ({"messages": HELLO, "top_logprobs": 2}, "invalid_value", "top_logprobs"),
    ({"messages": HELLO, "logit_bias": {"abc": 1}}, "invalid_value", "logit_bias"),
    ({"messages": HELLO, "functions": [{"name": "f"}]}, "unsupported_parameter", "functions"),
    ({"messages": HELLO, "seed": 2**64}, "invalid_value", "seed"),
])
def test_invalid_chat_fields_are_400_naming_the_param(engine: FakeEngine, body: dict, code: str, param: str) -> None:
    openai_error(client_for(engine).simulate_post(CHAT, json=body), 400, code, param)
    assert engine.added == []  # refused before anything reached the engine


def test_operator_limits_on_body_messages_and_max_tokens(engine: FakeEngine) -> None:
    client = client_for(engine, FrontendSettings(max_body_bytes=512, max_messages=2, max_tokens_limit=16))
    openai_error(client.simulate_post(CHAT, json={"messages": HELLO * 3}), 400, "array_above_max_length", "messages")
    openai_error(client.simulate_post(CHAT, json={"messages": HELLO, "max_completion_tokens": 17}), 400,
                 "max_tokens_exceeded", "max_completion_tokens")
    big = client.simulate_post(CHAT, json={"messages": [{"role": "user", "content": "x" * 600}]})
    assert openai_error(big, 413, "request_too_large")["type"] == "invalid_request_error"
    assert engine.added == []


# -- chat answers ---------------------------------------------------------------------------
def test_chat_json_answer_and_the_add_it_sent(engine: FakeEngine) -> None:
    result = client_for(engine).simulate_post(CHAT, json={
        "model": MODEL, "messages": [{"role": "developer", "content": "Be brief."}, *HELLO],
        "max_tokens": 8, "temperature": 0, "top_k": -1, "stop": "END"})
    assert result.status_code == 200, result.text
    body = result.json
    assert body["object"] == "chat.completion" and body["model"] == MODEL and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello there"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 0}}
    [add] = engine.added
    assert add["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert add["params"] == {"max_tokens": 8, "temperature": 0, "top_k": 0, "stop": ["END"]}
    assert result.headers["x-request-id"] == add["rid"]
    assert engine.released == [(add["rid"], "request_ended")] and engine.aborted == []


def test_chat_stream_relays_each_update_then_usage_and_done(engine: FakeEngine) -> None:
    result = client_for(engine).simulate_post(CHAT, json={
        "messages": HELLO, "stream": True, "stream_options": {"include_usage": True}})
    assert result.status_code == 200 and result.headers["content-type"].startswith("text/event-stream")
    events = sse_events(result.text)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": " there"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "stop"]
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7
    assert len({c["id"] for c in chunks}) == 1
    assert engine.released == [(engine.added[0]["rid"], "finished")] and engine.aborted == []


def test_chat_stream_reports_an_engine_error_in_band(engine: FakeEngine) -> None:
    engine.script = lambda request: [{"text": "Hel"}, {"error": error_body(503, "engine_restarted",
                                                                            error_type="server_error")}]
    events = sse_events(client_for(engine).simulate_post(CHAT, json={"messages": HELLO, "stream": True}).text)
    assert events[-1] == (None, "[DONE]")
    error = json.loads(events[-2][1])["error"]
    assert error["code"] == "engine_restarted" and error["type"] == "server_error"


def test_n_choices_are_n_requests_with_offset_seeds(engine: FakeEngine) -> None:
    result = client_for(engine).simulate_post(CHAT, json={"messages": HELLO, "n": 3, "seed": 7})
    assert [choice["index"] for choice in result.json["choices"]] == [0, 1, 2]
    assert [add["params"]["seed"] for add in engine.added] == [7, 8, 9]
    assert result.json["usage"]["prompt_tokens"] == 5 and result.json["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(("status", "code", "retry_after"), [(400, "context_length_exceeded", None),
                                                               (429, "queue_full", "1")])
def test_an_engine_refusal_is_the_http_error(engine: FakeEngine, status: int, code: str,
                                             retry_after: str | None) -> None:
    engine.refusal = error_body(status, code, "no room", param="messages")
    result = client_for(engine).simulate_post(CHAT, json={"messages": HELLO})
    openai_error(result, status, code, "messages")
    assert result.headers.get("retry-after") == retry_after


def test_engine_down_is_503_engine_unavailable(engine: FakeEngine) -> None:
    engine.up = False
    result = client_for(engine).simulate_post(CHAT, json={"messages": HELLO})
    assert openai_error(result, 503, "engine_unavailable")["type"] == "server_error"
    assert result.headers["retry-after"] == "1"


def test_a_client_that_hangs_up_aborts_its_request(engine: FakeEngine) -> None:
    engine.script = lambda request: []  # accepted, then nothing: the client leaves first
    result = client_for(engine, hang_up=True).simulate_post(CHAT, json={"messages": HELLO})
    assert result.status_code == 499
    assert engine.aborted == [(engine.added[0]["rid"], "client_disconnected")]


def test_context_overflow_is_reported(engine: FakeEngine) -> None:
    engine.accepted_extra = {"context_overflow": {"mode": "truncated", "dropped_messages": 2}}
    result = client_for(engine).simulate_post(CHAT, json={"messages": HELLO})
    assert result.headers["x-context-overflow"] == "truncated"
    assert result.json["usage"]["context_overflow"] == {"mode": "truncated", "dropped_messages": 2}


def test_unknown_route_and_wrong_method_in_openai_shape(engine: FakeEngine) -> None:
    client = client_for(engine)
    openai_error(client.simulate_get("/v1/nothing-here"), 404, "not_found")
    openai_error(client.simulate_get(CHAT), 405, "method_not_allowed")


# -- completions and responses ----------------------------------------------------------------
@pytest.mark.parametrize(("body", "code", "param"), [
    ({"prompt": ["one", 2]}, "invalid_type", "prompt"),
    ({"prompt": [[1], [-2]]}, "invalid_value", "prompt"),
    ({"prompt": ["x"] * 65}, "invalid_value", "prompt"),
    ({"prompt": ["x"] * 9, "n": 16}, "invalid_value", "n"),
    ({"prompt": [1, -2]}, "invalid_value", "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "invalid_value", "max_tokens"),  # 0 only when scoring the prompt
    ({"prompt": "hi", "echo": True, "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"prompt": "hi", "logprobs": 21}, "invalid_value", "logprobs"),
    ({"prompt": "hi", "logprobs": True}, "invalid_type", "logprobs"),
    ({"prompt": "hi", "echo": "yes"}, "invalid_type", "echo"),
    ({}, "missing_required_parameter", "prompt"),
])
def test_invalid_completions_are_400(engine: FakeEngine, body: dict, code: str, param: str) -> None:
    openai_error(client_for(engine).simulate_post("/v1/completions", json=body), 400, code, param)


def test_completion_defaults_to_16_tokens_and_answers_text(engine: FakeEngine) -> None:
    result = client_for(engine).simulate_post("/completions", json={"prompt": [1, 2, 3]})  # no /v1 works too
    assert result.json["object"] == "text_completion" and result.json["choices"][0]["text"] == "Hello there"
    assert engine.added[0]["prompt"] == [1, 2, 3] and engine.added[0]["params"]["max_tokens"] == 16


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"model": MODEL}, "missing_required_parameter", "input"),
    ({"input": "hi", "background": True}, "unsupported_parameter", "background"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file"}]}]}, None, None),
])
def test_invalid_responses_are_400(engine: FakeEngine, body: dict, code: str | None, param: str | None) -> None:
    result = client_for(engine).simulate_post("/v1/responses", json=body)
    if code is None:  # the exact code/param of nested items is the parser's business: the envelope is ours
        assert result.status_code == 400 and set(result.json["error"]) == {"message", "type", "param", "code"}
    else:
        openai_error(result, 400, code, param)


def test_response_answer_is_stored_in_the_engine(engine: FakeEngine) -> None:
    result = client_for(engine).simulate_post("/v1/responses", json={"input": "Hello", "instructions": "Be brief."})
    assert result.status_code == 200, result.text
    assert result.json["status"] == "completed" and result.json["id"].startswith("resp_")
    assert result.json["output"][0]["content"][0]["text"] == "Hello there"
    assert engine.added[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    [(method, args)] = engine.calls
    assert method == "responses.put" and args["id"] == result.json["id"]
    assert args["record"]["messages"][-1]["content"] == "Hello there"


def test_unknown_previous_response_is_404(engine: FakeEngine) -> None:
    result = client_for(engine).simulate_post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_x"})
    openai_error(result, 404, "response_not_found", "previous_response_id")
    assert engine.calls == [("responses.get", {"id": "resp_x"})] and engine.added == []


# -- Anthropic Messages ---------------------------------------------------------------------------
def test_anthropic_errors_come_in_anthropic_shape(engine: FakeEngine) -> None:
    client = client_for(engine)
    anthropic_error(client.simulate_post("/v1/messages", json={"messages": HELLO}), 400, "invalid_request_error")
    anthropic_error(client.simulate_post("/v1/messages", body=b"{", headers={"content-type": "application/json"}),
                    400, "invalid_request_error")
    anthropic_error(client.simulate_post("/v1/messages/nope", json={}), 404, "not_found_error")
    engine.up = False
    anthropic_error(client.simulate_post("/v1/messages", json={"max_tokens": 8, "messages": HELLO}), 503,
                    "overloaded_error")


def test_anthropic_message_and_its_event_stream(engine: FakeEngine) -> None:
    engine.script = lambda request: say("Hi", stop_sequence="END")
    client = client_for(engine)
    body = {"model": MODEL, "max_tokens": 8, "messages": HELLO, "stop_sequences": ["END"]}
    message = client.simulate_post("/v1/messages", json=body).json
    assert message["type"] == "message" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "text", "text": "Hi"}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert message["usage"] == {"input_tokens": 5, "output_tokens": 1, "cache_read_input_tokens": 0,
                                "cache_creation_input_tokens": 0}
    events = sse_events(client.simulate_post("/v1/messages", json={**body, "stream": True}).text)
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "content_block_stop", "message_delta", "message_stop"]
    assert all(json.loads(data)["type"] == name for name, data in events)


def test_count_tokens_asks_the_engine_to_tokenize(engine: FakeEngine) -> None:
    result = client_for(engine).simulate_post("/v1/messages/count_tokens", json={"model": MODEL, "messages": HELLO})
    assert result.json == {"input_tokens": 3}
    [(method, args)] = engine.calls
    assert method == "tokenize" and args["messages"] == [{"role": "user", "content": "Hello"}]


# -- API keys -------------------------------------------------------------------------------------
def test_api_keys_guard_every_route_but_health(engine: FakeEngine) -> None:
    client = client_for(engine, FrontendSettings(api_keys=("sk-one", "sk-two")))
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-one-and-more"}):
        result = client.simulate_get("/v1/models", headers=headers)
        assert openai_error(result, 401, "invalid_api_key")["type"] == "authentication_error"
        assert result.headers["www-authenticate"] == "Bearer"
    anthropic_error(client.simulate_post("/v1/messages", json={}), 401, "authentication_error")
    assert client.simulate_get("/v1/models", headers={"Authorization": "Bearer sk-two"}).status_code == 200
    assert client.simulate_get("/v1/models", headers={"x-api-key": "sk-one"}).status_code == 200
    assert client.simulate_get("/health").status_code == 200
    assert engine.methods_called() == ["list_models", "list_models", "status"]
    assert engine.added == []
