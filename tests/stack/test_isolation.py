"""No client can hurt another: a request that breaks something breaks only itself (issue: isolation).

Each test plays one attack against the real engine + gunicorn front-end while a victim
stream runs, and checks the victim sees no error and the engine serves the next request.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq

from model_builders.text import derive_model
from protocol import PROTOCOL_VERSION, MsgType, decode, encode
from tests.helpers import Engine, Frontend, client_for, running_stack

# A ChatML template with no tool-call markup: mlx-lm finds no tool parser for it, so the engine's
# JSON fallback reads a reply that starts with "{" as a tool call, and the model writes the whole call.
PLAIN_CHATML = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
                "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


class Victim(threading.Thread):
    """A long greedy stream that records every chunk and any error it sees."""

    def __init__(self, frontend: Frontend, model: str, max_tokens: int = 48):
        super().__init__(daemon=True)
        self.client = client_for(frontend)
        self.model, self.max_tokens = model, max_tokens
        self.chunks = 0
        self.finish_reason: str | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "Tell me a long story"}],
                max_tokens=self.max_tokens, temperature=0, stream=True)
            for chunk in stream:
                self.chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
        except Exception as exc:  # the assertion below reports it
            self.error = exc

    def wait_for_first_chunk(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks == 0 and self.error is None and time.monotonic() < deadline:
            time.sleep(0.05)


def assert_engine_serves(frontend: Frontend, model: str) -> None:
    health = httpx.get(f"{frontend.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "healthy", health.text
    reply = client_for(frontend).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert reply.choices[0].message is not None


def test_a_model_made_tool_call_id_past_64_bits_ends_nothing(frontend: Frontend, tiny_model: Path) -> None:
    """Attack 1: the model writes `"id": 1000000000000000000000000000000` in a JSON-fallback tool call.

    Before: encoding the DELTAS frame raised in the mlx thread, which died; every stream hung.
    Now tool-call ids are always ids the engine mints, and an unencodable item would end only its request.
    """
    model = str(derive_model(tiny_model, tiny_model.parent / "tiny-plain-chatml", PLAIN_CHATML))
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments", "id"],
              "properties": {"name": {"const": "lookup"}, "id": {"const": 1e30},
                             "arguments": {"type": "object", "properties": {}, "additionalProperties": False}}}
    victim = Victim(frontend, model)
    victim.start()
    victim.wait_for_first_chunk()
    attack = client_for(frontend).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "call it"}], max_tokens=64, temperature=0,
        tools=[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": schema}})
    calls = attack.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "lookup"
    assert calls[0].id.startswith("call_") and len(calls[0].id) < 64
    victim.join(120)
    assert victim.error is None and victim.finish_reason == "length"
    assert_engine_serves(frontend, model)


def logged_at(log: str, text: str) -> float:
    """Seconds of the day of the first engine log line containing `text` ("2026-11-23 20:01:02,345 ...")."""
    line = next(line for line in log.splitlines() if text in line)
    clock = line.split()[1]
    hours, minutes, seconds = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds.replace(",", "."))


def test_a_dead_mlx_thread_stops_the_engine_with_a_failure_status(tiny_model: Path, ipc_dir: Path,
                                                                   tmp_path: Path) -> None:
    """A live process with a dead mlx thread would hang every stream: the engine exits non-zero instead."""
    engine = Engine(f"ipc://{ipc_dir}/crash.sock", tmp_path / "engined.log", model=str(tiny_model),
                    env={"MLX_ENGINE_FAULT_INJECTION": "1"})
    try:
        engine.wait_ready()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine.endpoint)
        sock.send(encode(MsgType.CALL, {"cid": "crash", "method": "debug_crash", "args": {}}))
        try:
            status = engine.popen.wait(60)
        finally:
            sock.close()
        assert status == 70, engine.log()
        log = engine.log()
        assert "mlx thread crashed" in log and "the mlx thread died: stopping the engine" in log
        # The engine's own clock: from the crash to the process being done, well within 2 s.
        assert logged_at(log, "mlx thread crashed") + 2.0 > logged_at(log, "engine stopped")
    finally:
        engine.stop()


def test_a_peer_whose_hello_was_refused_is_not_served(engine: Engine) -> None:
    """Attack 13: before, a front-end refused for its protocol version was served anyway."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.endpoint)

    def answer(timeout: float) -> tuple[MsgType, dict] | None:
        return decode(sock.recv()) if sock.poll(int(timeout * 1000)) else None

    try:
        sock.send(encode(MsgType.HELLO, {"version": 999, "frontend_id": "old"}))
        kind, body = answer(10)
        assert kind == MsgType.ERROR and body["code"] == "protocol_version_mismatch"
        sock.send(encode(MsgType.PING, {"t": 1.0}))
        sock.send(encode(MsgType.CALL, {"cid": "c", "method": "status", "args": {}}))
        sock.send(encode(MsgType.ADD, {"rid": "old:1", "model": "x", "prompt": "hi", "params": {}}))
        assert answer(2) is None  # nothing at all until a correct HELLO
        sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION, "frontend_id": "new"}))
        kind, _ = answer(10)
        assert kind == MsgType.WELCOME
        sock.send(encode(MsgType.PING, {"t": 2.0}))
        kind, body = answer(10)
        assert kind == MsgType.PONG and body["t"] == 2.0
    finally:
        sock.close()


@pytest.mark.parametrize("kwargs,named", [
    ({"tokenize": False}, "tokenize"),
    ({"return_tensors": "mlx"}, "return_tensors"),
    ({"chat_template": "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"},
     "chat_template"),
    ({"enable_thinking": False, "return_dict": True, "tools": []}, "return_dict"),
])
def test_template_call_arguments_in_chat_template_kwargs_are_refused(frontend: Frontend, model_id: str,
                                                                      kwargs: dict, named: str) -> None:
    """Attacks 2 and 3: `tokenize: false` broke every stream's next batch step; a client's Jinja ran for
    69 s on the mlx thread. Only template variables pass now, and the victim stream never notices."""
    victim = Victim(frontend, model_id)
    victim.start()
    victim.wait_for_first_chunk()
    response = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "chat_template_kwargs": kwargs})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and named in error["message"]
    victim.join(120)
    assert victim.error is None and victim.finish_reason == "length"
    assert_engine_serves(frontend, model_id)


def test_plain_template_variables_still_reach_the_template(frontend: Frontend, model_id: str) -> None:
    reply = client_for(frontend).chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False, "custom": {"nested": [1, 2.5, "x", None]}}})
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stop,limit", [(["x" * 1025], "1024 characters"), ([f"s{i}" for i in range(17)], "16")])
def test_stop_strings_are_bounded(frontend: Frontend, model_id: str, stop: list[str], limit: str) -> None:
    """Attack 5: 16 long stop strings slowed another client's stream from 255 to 8 events/s."""
    response = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": stop})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop" and limit in error["message"]


@pytest.mark.parametrize("name", ["m" * 300, "é" * 200, "/" + "a/" * 200])
def test_overlong_model_names_get_a_400_and_a_short_log_line(frontend: Frontend, engine: Engine, name: str) -> None:
    """Attack 14: a name over 255 bytes was a 500 and a 1 MB engine log line."""
    response = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_model_name"
    assert max(len(line) for line in engine.log().splitlines()) < 4096


def engine_stats(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/stats", timeout=30).json()


def test_huge_prompts_are_refused_off_the_mlx_thread(frontend: Frontend, model_id: str) -> None:
    """Attack 4: 4 MB of messages froze every stream for 3.6 s while the mlx thread rendered and tokenized it.

    Now the byte size alone refuses it before any rendering, and a prompt under that bound is rendered and
    tokenized on the admission pool (the engine counts both); the victim stream runs on untouched."""
    before = engine_stats(frontend)
    victim = Victim(frontend, model_id, max_tokens=64)
    victim.start()
    victim.wait_for_first_chunk()
    huge = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=120, json={
        "model": model_id, "max_tokens": 4,
        "messages": [{"role": "user", "content": "word " * 200_000} for _ in range(4)]})
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded", huge.text
    large = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=120, json={
        "model": model_id, "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 60_000}]})
    assert large.status_code == 400 and large.json()["error"]["code"] == "context_length_exceeded", large.text
    after = engine_stats(frontend)
    assert after["prompts_refused_by_size"] == before["prompts_refused_by_size"] + 1
    assert after["prompts_prepared"] >= before["prompts_prepared"] + 2
    victim.join(120)
    assert victim.error is None and victim.finish_reason == "length"
    assert_engine_serves(frontend, model_id)


def test_grammars_compile_off_the_mlx_thread_and_are_probed(frontend: Frontend, model_id: str) -> None:
    """Red team, attack 4 and 5: a 10 MB enum froze every stream for ~8 s while the mlx thread compiled it, and a
    grammar failing at its first token (a required recursive `$ref`) was a 200 with the tool_choice promise dropped.

    Now a request's grammar is compiled with its prompt on the admission pool (the engine counts it), schemas
    past 1 MB are refused unread, and a new grammar is followed for a few tokens before it is used. A value the
    engine refuses anyway is checked before the compile."""
    before = engine_stats(frontend)
    victim = Victim(frontend, model_id, max_tokens=64)
    victim.start()
    victim.wait_for_first_chunk()
    url = f"{frontend.base_url}/v1/chat/completions"
    base = {"model": model_id, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    enum = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [f"v{i}" for i in range(5_000)]}}}
    ok = httpx.post(url, timeout=120, json={**base, "response_format": enum})
    assert ok.status_code == 200 and json.loads(ok.json()["choices"][0]["message"]["content"]) in enum[
        "json_schema"]["schema"]["enum"]
    huge = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [f"v{i}" for i in range(300_000)]}}}
    refused = httpx.post(url, timeout=120, json={**base, "response_format": huge})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format", refused.text
    recursive = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": recursive}}]
    failing = httpx.post(url, timeout=120, json={**base, "tools": tools, "tool_choice": "required"})
    assert failing.status_code == 400 and failing.json()["error"]["param"] == "tool_choice", failing.text
    after = engine_stats(frontend)
    assert after["processors_prepared"] >= before["processors_prepared"] + 1
    # A value only the engine can check (a token id past the vocabulary) is refused before any compile.
    bad_bias = httpx.post(url, timeout=120, json={**base, "response_format": enum, "logit_bias": {"99999999": 1}})
    assert bad_bias.status_code == 400 and bad_bias.json()["error"]["param"] == "logit_bias", bad_bias.text
    assert engine_stats(frontend)["processors_prepared"] == after["processors_prepared"]
    victim.join(120)
    assert victim.error is None and victim.finish_reason == "length"
    assert_engine_serves(frontend, model_id)


def order_of(log: str, event: str) -> list[str]:
    """Request ids in the order the engine logged `event` ("accepted", "finished") for them."""
    return [line.split("rid=")[1].split()[0] for line in log.splitlines() if f" {event} " in line and "rid=" in line]


def send_while_held(sock: zmq.Socket, engine: Engine, name: str, max_tokens: int) -> list[tuple[str, str]]:
    """Client a's four requests, then client b's one, sent while the mlx thread sleeps: admitted together."""
    sock.connect(engine.endpoint)
    sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION, "frontend_id": name}))
    sock.send(encode(MsgType.CALL, {"cid": "hold", "method": "debug_sleep", "args": {"seconds": 1.5}}))
    rids = [("a", f"{name}:a{i}") for i in range(4)] + [("b", f"{name}:b0")]
    for client, rid in rids:
        sock.send(encode(MsgType.ADD, {"rid": rid, "client": client, "prompt": [1, 2, 3, 4],
                                       "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}))
    return rids


@pytest.mark.parametrize("ceiling", [0, 1])
def test_decode_slots_are_shared_between_clients(tiny_model: Path, ipc_dir: Path, tmp_path: Path,
                                                 ceiling: int) -> None:
    """Attack 12: one client's burst took every decode slot and starved the others.

    Client A sends four requests, then client B one, while the mlx thread is held so all five are
    queued together; the engine's log says who got a slot when."""
    engine = Engine(f"ipc://{ipc_dir}/fair{ceiling}.sock", tmp_path / "engined.log", model=str(tiny_model),
                    args=["--decode-concurrency", "2", "--max-slots-per-key", str(ceiling)],
                    env={"MLX_ENGINE_FAULT_INJECTION": "1"})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        engine.wait_ready()
        rids = send_while_held(sock, engine, "fair", 24)
        finished: set[str] = set()
        deadline = time.monotonic() + 120
        while len(finished) < len(rids) and time.monotonic() < deadline:
            if sock.poll(1000):
                kind, body = decode(sock.recv())
                if kind == MsgType.DELTAS:
                    finished |= {item["rid"] for item in body["items"] if item.get("finish_reason")}
                assert kind != MsgType.ERROR, body
        assert finished == {rid for _, rid in rids}
        accepted = order_of(engine.log(), "accepted")
        if ceiling == 0:
            # a0 and a1 fill both slots; when they free, a and b hold none and each gets one (first in first
            # out would have made b wait behind all four of a's).
            assert accepted[:2] == ["fair:a0", "fair:a1"] and accepted.index("fair:b0") < accepted.index("fair:a3")
        else:
            # a holds at most one slot: b takes the second at once, a's others wait for a's own slot.
            assert accepted[:2] == ["fair:a0", "fair:b0"], accepted
            log = engine.log()
            assert log.index("rid=fair:a0 finished") < log.index("rid=fair:a1 accepted")
    finally:
        sock.close()
        engine.stop()


def test_one_client_cannot_fill_the_queue(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """Red team: with one shared --max-queued, client A's burst filled the queue and B got 429 queue_full.

    Now a full queue makes the client holding 2+ more of it than the newcomer's give up its newest place."""
    engine = Engine(f"ipc://{ipc_dir}/queue.sock", tmp_path / "engined.log", model=str(tiny_model),
                    args=["--decode-concurrency", "1", "--max-queued", "3"], env={"MLX_ENGINE_FAULT_INJECTION": "1"})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        engine.wait_ready()
        rids = send_while_held(sock, engine, "queue", 8)  # a0 runs, a1 and a2 queue, a3 and b0 find it full
        finished: set[str] = set()
        refused: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while len(finished) + len(refused) < len(rids) and time.monotonic() < deadline:
            if sock.poll(1000):
                kind, body = decode(sock.recv())
                if kind == MsgType.DELTAS:
                    finished |= {item["rid"] for item in body["items"] if item.get("finish_reason")}
                elif kind == MsgType.ERROR and body.get("rid"):
                    refused[body["rid"]] = body["code"]
        # a3 finds the queue full of a's own; b0 finds it full of a's and takes a2's place
        assert refused == {"queue:a3": "queue_full", "queue:a2": "queue_full"}, (refused, engine.log())
        assert finished == {"queue:a0", "queue:a1", "queue:b0"}
    finally:
        sock.close()
        engine.stop()


def test_a_client_template_runs_under_budget_when_the_operator_allows_it(tiny_model: Path, ipc_dir: Path,
                                                                          tmp_path: Path) -> None:
    """Attack 3 with --allow-request-chat-template: the model's own template sent by the client gives the
    same answer; a runaway loop is stopped by its budget while a victim stream runs on."""
    with running_stack(f"ipc://{ipc_dir}/tmpl.sock", tmp_path, model=str(tiny_model),
                       engine_args=["--allow-request-chat-template"]) as (engine, frontend):
        model = str(tiny_model)
        own = json.loads((tiny_model / "tokenizer_config.json").read_text())["chat_template"]
        ask = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
        plain = httpx.post(f"{frontend.base_url}/v1/chat/completions", json=ask, timeout=60).json()
        sent = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60,
                          json={**ask, "chat_template_kwargs": {"chat_template": own}}).json()
        assert sent["choices"][0]["message"] == plain["choices"][0]["message"]
        victim = Victim(frontend, model)
        victim.start()
        victim.wait_for_first_chunk()
        loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        runaway = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60,
                             json={**ask, "chat_template_kwargs": {"chat_template": loop}})
        assert runaway.status_code == 400 and runaway.json()["error"]["code"] == "chat_template_budget_exceeded"
        victim.join(120)
        assert victim.error is None and victim.finish_reason == "length"
        assert_engine_serves(frontend, model)


@pytest.mark.parametrize("metadata", [{f"k{i}": "v" for i in range(17)}, {"k": "v" * 513}, {"k" * 65: "v"},
                                      {"k": [{}] * 1_000_000}])
def test_responses_metadata_is_bounded_like_openai(frontend: Frontend, model_id: str, metadata: dict) -> None:
    """Attack 8: a million empty maps in `metadata` grew the engine's store ~70x past its cap."""
    response = httpx.post(f"{frontend.base_url}/v1/responses", timeout=60, json={
        "model": model_id, "input": "hi", "max_output_tokens": 4, "metadata": metadata})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "metadata"
    ok = httpx.post(f"{frontend.base_url}/v1/responses", timeout=60, json={
        "model": model_id, "input": "hi", "max_output_tokens": 4, "metadata": {f"k{i}": "v" * 512 for i in range(16)}})
    assert ok.status_code == 200 and ok.json()["metadata"]["k15"] == "v" * 512


def test_stop_limits_are_the_operators_to_set(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    with running_stack(f"ipc://{ipc_dir}/stops.sock", tmp_path, model=str(tiny_model),
                       engine_args=["--max-stop-strings", "2", "--max-stop-length", "64"],
                       frontend_args=["--max-stop-strings", "32", "--max-stop-length", "8"]) as (_, frontend):
        ask = {"model": str(tiny_model), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        by_engine = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60,
                               json={**ask, "stop": ["a", "b", "c"]})
        assert by_engine.status_code == 400 and "at most 2 stop strings" in by_engine.json()["error"]["message"]
        by_frontend = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60,
                                 json={**ask, "stop": ["123456789"]})
        assert by_frontend.status_code == 400 and "at most 8 characters" in by_frontend.json()["error"]["message"]
        fine = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={**ask, "stop": ["a", "b"]})
        assert fine.status_code == 200
