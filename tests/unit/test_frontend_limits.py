"""The front-end's own limits against hostile input (issue 13), in-process: no engine, no gunicorn.

Unencodable bodies, overlong names and stop strings, reserved template arguments, ADDs too large
for one frame, a stream whose client stops reading, and a heartbeat that must not take its own
worker's stall for the engine's death. The same attacks against real processes are in
tests/stack/test_frontend_limits.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from http_frontend.engine.client import EngineClient, RequestStream
from http_frontend.engine.frames import UnsendableRequest, delta_bytes, packed_frame
from http_frontend.errors import APIError
from http_frontend.parsing.body import OFF_LOOP_BYTES, parse_json_object
from protocol import MsgType, decode
from protocol.messages import MAX_FRAME_BYTES
from tests.unit.fake_engine import FakeEngine, client_for

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello"}]
JSON = {"content-type": "application/json"}


def openai_error(result: Any, status: int, code: str, param: str | None) -> dict:
    assert result.status_code == status, result.text
    assert set(result.json) == {"error"} and set(result.json["error"]) == {"message", "type", "param", "code"}
    assert (result.json["error"]["code"], result.json["error"]["param"]) == (code, param), result.json
    return result.json["error"]


def top_logprobs_item(rid: str, seq: int) -> dict[str, Any]:
    def alternative(i: int) -> dict[str, Any]:
        return {"token": f"tok{i}", "logprob": -1.0, "bytes": list(f"tok{i}".encode())}
    return {"rid": rid, "seq": seq, "text": "tok", "token_ids": [seq],
            "logprobs": [{**alternative(0), "top_logprobs": [alternative(i) for i in range(20)]}]}


# -- (14) unencodable input ---------------------------------------------------------------------
@pytest.mark.parametrize("raw,param", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.[0].content"),
    (b'{"messages": [], "chat_template_kwargs": {"k": ["\\udfff"]}}', "chat_template_kwargs.k.[0]"),
    (b'{"messages": [], "tools": [{"x": 123456789012345678901234567890}]}', "tools.[0].x"),
    (b'{"messages": [], "metadata": {"n": -9223372036854775809}}', "metadata.n"),
    (b'{"messages": [], "metadata": {"\\udfff": 1}}', "metadata.\\udfff"),  # a key: named escaped
    (b'{"messages": [], "x": "\xed\xa0\x80"}', "x"),  # a surrogate encoded in the raw UTF-8
])
def test_unencodable_values_anywhere_are_a_400_naming_the_field(raw: bytes, param: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_json_object(raw)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "invalid_value", param)


def test_what_msgpack_carries_passes() -> None:
    body = parse_json_object(b'{"a": 18446744073709551615, "b": -9223372036854775808, "c": "\\ud83d\\ude00"}')
    assert body == {"a": 2**64 - 1, "b": -2**63, "c": "\N{GRINNING FACE}"}


def test_a_body_nested_past_the_recursion_limit_is_400() -> None:
    with pytest.raises(APIError) as caught:
        parse_json_object(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")


@pytest.mark.parametrize("path,envelope", [(CHAT, "openai"), ("/v1/completions", "openai"),
                                           ("/v1/responses", "openai"), ("/v1/messages", "anthropic")])
def test_a_lone_surrogate_is_a_400_in_each_routes_envelope(path: str, envelope: str) -> None:
    engine = FakeEngine()
    field = {"/v1/completions": '"prompt": "hi \\ud800"', "/v1/responses": '"input": "hi \\ud800"'}.get(
        path, '"messages": [{"role": "user", "content": "hi \\ud800"}]')
    result = client_for(engine).simulate_post(path, body=f'{{"model": "m", "max_tokens": 4, {field}}}', headers=JSON)
    assert result.status_code == 400, result.text
    if envelope == "anthropic":
        assert result.json["type"] == "error" and result.json["error"]["type"] == "invalid_request_error"
    else:
        assert result.json["error"]["code"] == "invalid_value"
    assert engine.added == [] and engine.streams == {}


def test_a_large_body_is_parsed_off_the_event_loop_and_still_served() -> None:
    engine = FakeEngine()
    big = {"messages": [{"role": "user", "content": "word " * (OFF_LOOP_BYTES // 4)}]}
    assert client_for(engine).simulate_post(CHAT, json=big).status_code == 200
    bad = json.dumps(big).encode()[:-1] + b', "x": "\\ud800"}'
    openai_error(client_for(engine).simulate_post(CHAT, body=bad, headers=JSON), 400, "invalid_value", "x")


@pytest.mark.parametrize("path,extra", [(CHAT, {"messages": HELLO}), ("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/responses", {"input": "hi"}), ("/v1/tokenize", {"prompt": "hi"})])
@pytest.mark.parametrize("name", ["m" * 256, "\N{LATIN SMALL LETTER E WITH ACUTE}" * 128])
def test_model_names_over_255_bytes_are_refused_by_the_front_end(path: str, extra: dict, name: str) -> None:
    engine = FakeEngine()
    openai_error(client_for(engine).simulate_post(path, json={"model": name, **extra}), 400, "invalid_model_name",
                 "model")
    assert engine.added == [] and engine.calls == []


def test_a_model_name_of_255_bytes_passes() -> None:
    engine = FakeEngine()
    assert client_for(engine).simulate_post(CHAT, json={"model": "m" * 255, "messages": HELLO}).status_code == 200


# -- (5) stop strings ------------------------------------------------------------------------------
def test_each_stop_string_is_at_most_1024_characters() -> None:
    engine = FakeEngine()
    client = client_for(engine)
    error = openai_error(client.simulate_post(CHAT, json={"messages": HELLO, "stop": ["ok", "x" * 1025]}), 400,
                         "invalid_value", "stop")
    assert "1024 characters" in error["message"]
    openai_error(client.simulate_post(CHAT, json={"messages": HELLO, "stop": "x" * 1025}), 400, "invalid_value",
                 "stop")
    assert client.simulate_post(CHAT, json={"messages": HELLO, "stop": ["x" * 1024]}).status_code == 200
    assert engine.added[-1]["params"]["stop"] == ["x" * 1024]
    anthropic = client.simulate_post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": HELLO,
                                                            "stop_sequences": ["y" * 1025]})
    assert anthropic.status_code == 400 and "1024" in anthropic.json["error"]["message"]


# -- chat_template_kwargs --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,named", [
    ({"tokenize": False}, "tokenize"), ({"return_tensors": "mlx"}, "return_tensors"),
    ({"enable_thinking": False, "return_dict": True, "tools": []}, "return_dict"),
    ({"add_generation_prompt": False}, "add_generation_prompt"), ({"tokenizer_kwargs": {}}, "tokenizer_kwargs"),
])
@pytest.mark.parametrize("path,extra", [(CHAT, {"messages": HELLO}), ("/v1/responses", {"input": "hi"}),
                                        ("/v1/tokenize", {"messages": HELLO})])
def test_template_call_arguments_are_refused_naming_them(path: str, extra: dict, kwargs: dict, named: str) -> None:
    engine = FakeEngine()
    error = openai_error(client_for(engine).simulate_post(path, json={**extra, "chat_template_kwargs": kwargs}),
                         400, "invalid_value", "chat_template_kwargs")
    assert named in error["message"]
    assert engine.added == [] and engine.calls == []


def test_chat_template_and_plain_variables_pass_to_the_engine() -> None:
    """`chat_template` is the engine's decision (--allow-request-chat-template), not the front-end's."""
    engine = FakeEngine()
    kwargs = {"chat_template": "{{ messages }}", "custom": {"nested": [1, 2.5, "x", None]}}
    result = client_for(engine).simulate_post(CHAT, json={"messages": HELLO, "chat_template_kwargs": kwargs})
    assert result.status_code == 200
    assert engine.added[0]["chat_template_kwargs"] == kwargs


def test_chat_template_kwargs_must_be_an_object() -> None:
    engine = FakeEngine()
    openai_error(client_for(engine).simulate_post(CHAT, json={"messages": HELLO, "chat_template_kwargs": ["x"]}),
                 400, "invalid_type", "chat_template_kwargs")


# -- (6) the packed frame ----------------------------------------------------------------------------
def floats_request(count: int) -> dict[str, Any]:
    return {"messages": HELLO, "params": {}, "chat_template_kwargs": {"v": [0.5] * count}}


def test_an_add_larger_than_a_frame_once_packed_is_refused_before_sending() -> None:
    count = MAX_FRAME_BYTES // 9 + 1  # a float packs into 9 bytes
    with pytest.raises(UnsendableRequest) as caught:
        packed_frame(MsgType.ADD, {**floats_request(count), "rid": "fe:1"})
    assert caught.value.too_large
    error = caught.value.api_error()
    assert (error.status, error.code) == (413, "request_too_large")
    fits = packed_frame(MsgType.ADD, {**floats_request(1000), "rid": "fe:1"})
    assert decode(fits)[1]["chat_template_kwargs"]["v"][0] == 0.5


def test_an_unencodable_add_names_its_field() -> None:
    with pytest.raises(UnsendableRequest) as caught:
        packed_frame(MsgType.ADD, {"rid": "fe:1", "messages": HELLO, "params": {}, "tools": [{"id": 10**30}]})
    assert not caught.value.too_large and caught.value.param == "tools"
    assert (caught.value.api_error().status, caught.value.api_error().param) == (400, "tools")


def ready_client(**kwargs: Any) -> EngineClient:
    """An EngineClient that believes its engine is up; with no socket, a send fails as for a vanished engine."""
    client = EngineClient("ipc:///nonexistent/engine.sock", **kwargs)
    client._ready.set()
    client.last_heard = time.monotonic()
    return client


def test_a_refused_add_leaves_no_stream_record() -> None:
    async def run() -> None:
        client = ready_client()
        with pytest.raises(UnsendableRequest):
            await client.submit(floats_request(MAX_FRAME_BYTES // 9 + 1))
        with pytest.raises(UnsendableRequest):
            await client.submit({"messages": HELLO, "params": {}, "chat_template_kwargs": {"s": "\ud800"}})
        assert client.streams == {}

    asyncio.run(run())


def test_a_too_large_request_is_413_over_http() -> None:
    """The route maps the client's refusal: a real EngineClient behind the app, no engine needed to refuse."""
    client = ready_client()
    client.start = client.close = _nothing  # no socket in this test
    body = {"messages": HELLO, "chat_template_kwargs": {"v": [0.5] * (MAX_FRAME_BYTES // 9 + 1)}}
    raw = json.dumps(body, separators=(",", ":"))
    result = client_for(client).simulate_post(CHAT, body=raw, headers=JSON)
    openai_error(result, 413, "request_too_large", None)
    assert client.streams == {}


async def _nothing() -> None:
    return None


# -- (9) a client that stops reading -------------------------------------------------------------------
def test_top_logprobs_are_counted_against_the_pending_cap() -> None:
    item = top_logprobs_item("fe:1", 0)
    assert delta_bytes(item) > 21 * 320
    assert delta_bytes({"text": "abc", "token_ids": [1]}) == 3 + 8

    async def run() -> None:
        stream = RequestStream("fe:1", max_pending_bytes=100_000)
        for seq in range(10):
            stream.on_deltas(top_logprobs_item("fe:1", seq))
        assert not stream.over_limit
        update = await stream.next_update(0.1)  # a reader that keeps up never comes near the cap
        assert len(update.logprobs) == 10 and stream.pending_bytes == 0
        for seq in range(20):
            stream.on_deltas(top_logprobs_item("fe:1", seq))
        assert stream.over_limit

    asyncio.run(run())


class RecordingSocket:
    """Takes frames as a DEALER would (a done future per send); `answer` plays the engine's PONGs."""

    def __init__(self, client: EngineClient):
        self.client, self.sent, self.answering = client, [], True

    def send(self, frame: bytes, flags: int = 0) -> asyncio.Future:
        self.sent.append(decode(frame))
        if self.answering and self.sent[-1][0] == MsgType.PING:
            asyncio.get_running_loop().call_later(0.01, self._pong)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def _pong(self) -> None:
        self.client.last_heard = time.monotonic()

    def get(self, option: int) -> int:
        assert option == zmq.EVENTS
        return 0  # nothing waiting to be read


def test_a_stream_whose_client_stops_reading_is_cut_off_and_aborted() -> None:
    async def run() -> None:
        client = ready_client(max_pending_bytes=50_000)
        client._socket = RecordingSocket(client)
        stream = RequestStream("fe:slow", client.max_pending_bytes)
        client.streams["fe:slow"] = stream
        for seq in range(40):
            client._dispatch(MsgType.DELTAS, {"items": [top_logprobs_item("fe:slow", seq)]})
        assert client.streams == {}
        aborts = [body for kind, body in client._socket.sent if kind == MsgType.ABORT]
        assert aborts == [{"rids": ["fe:slow"], "reason": "slow_client"}]
        assert stream.error["code"] == "slow_client" and stream.pending_bytes == 0
        assert stream._pending.logprobs == []  # the memory is freed at once, not when the client reads

    asyncio.run(run())


# -- (7) a stalled worker is not a dead engine ----------------------------------------------------------
@pytest.mark.parametrize("engine_answers", [True, False])
def test_a_worker_stall_does_not_mark_a_live_engine_down(engine_answers: bool) -> None:
    """The event loop blocked for 4 x dead_after (as by parsing a large body): no ping went out meanwhile,
    so the engine's silence then says nothing. A really silent engine is still noticed."""
    async def run() -> None:
        client = ready_client(ping_interval=0.05, dead_after=0.4)
        sock = RecordingSocket(client)
        client._socket = sock
        heartbeat = asyncio.create_task(client._heartbeat_loop())
        try:
            await asyncio.sleep(0.3)
            sock.answering = engine_answers
            time.sleep(1.6)  # the worker's loop is blocked
            await asyncio.sleep(0.1)
            assert client.alive  # a request arriving now is submitted, not refused with 503
            await asyncio.sleep(0.8)
            assert client._ready.is_set() is engine_answers and client.alive is engine_answers
        finally:
            heartbeat.cancel()

    asyncio.run(run())


class HeldLoopSocket(RecordingSocket):
    """Answers each CALL the way a loaded worker sees it: the loop is held (by the JSON parser thread, in
    production) for `held` seconds, longer than the CALL's timeout, and the RESULT is dispatched a few loop
    turns after the loop is free again (socket readiness, zmq's poller, the read loop's task)."""

    def __init__(self, client: EngineClient, held: float | None):
        super().__init__(client)
        self.held = held

    def send(self, frame: bytes, flags: int = 0) -> asyncio.Future:
        future = super().send(frame, flags)
        kind, body = self.sent[-1]
        if kind == MsgType.CALL and self.held is not None:
            loop = asyncio.get_running_loop()
            answer = {"cid": body["cid"], "result": {"state": "ready"}}
            loop.call_soon(self._hold_then_answer, loop, answer)
        return future

    def _hold_then_answer(self, loop: asyncio.AbstractEventLoop, answer: dict[str, Any]) -> None:
        time.sleep(self.held)
        self._later(loop, 3, lambda: self.client._dispatch(MsgType.RESULT, answer))

    def _later(self, loop: asyncio.AbstractEventLoop, turns: int, callback: Callable[[], None]) -> None:
        loop.call_soon(callback if turns == 1 else lambda: self._later(loop, turns - 1, callback))


@pytest.mark.parametrize("engine_answers", [True, False])
def test_a_call_answered_while_the_worker_was_held_is_not_a_timeout(engine_answers: bool) -> None:
    """Before: `/health` answered 503 'unhealthy' when its 2 s status CALL spanned a 13 MB body being parsed
    (the C parser holds the GIL): the timer fired as the loop came back, before the reader took the answer
    that had arrived meanwhile. Only time the loop was free counts now; an engine that never answers still
    times out."""
    from http_frontend.engine.client import EngineUnavailable

    async def run() -> Any:
        client = ready_client()
        client._socket = HeldLoopSocket(client, held=0.6 if engine_answers else None)
        return await client.call("status", timeout=0.3)

    if engine_answers:
        assert asyncio.run(run()) == {"state": "ready"}
    else:
        with pytest.raises(EngineUnavailable, match="did not answer 'status'"):
            asyncio.run(run())


def test_the_garbage_collector_is_paused_only_while_a_body_is_parsed() -> None:
    """A parse makes only acyclic containers; collections during it walked every one made so far and tripled
    the time the parser held the GIL. It is back on after a parse, a refused one included."""
    import gc

    from http_frontend.parsing.body import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # a small body parsed on the loop while the parser thread runs
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(APIError):
        parse_json_object(b'{"a": [1, 2')
    assert parse_json_object(b'{"a": [[1, [2]]]}') == {"a": [[1, [2]]]} and gc.isenabled()
