"""The front-end's limits against hostile input (issue 13), against the real engine + gunicorn front-end.

Attacks 5, 6, 7, 9 and 14 of the issue: each attacker gets a clear 4xx (or its own error) from
the front-end, a victim stream running meanwhile sees no error, and the engine serves the next
request. In-process checks of the same limits are in tests/unit/test_frontend_limits.py.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, client_for, error_of
from tests.stack.test_isolation import Victim, assert_engine_serves

HELLO = [{"role": "user", "content": "hi"}]
RSS_CAP_MB = 400


def chat_url(frontend: Frontend) -> str:
    return f"{frontend.base_url}/v1/chat/completions"


def inflight_by_worker(frontend: Frontend, workers: int = 2) -> dict[str, float]:
    """`mlx_frontend_inflight_requests` (the worker's engine-client stream table) of every worker, by pid."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while len(seen) < workers and time.monotonic() < deadline:
        text = httpx.get(f"{frontend.base_url}/metrics", timeout=30).text
        for pid, value in re.findall(r'^mlx_frontend_inflight_requests\{pid="(\d+)"\} (\S+)$', text, re.M):
            seen[pid] = float(value)
    assert len(seen) == workers, seen
    return seen


def worker_pids(frontend: Frontend) -> list[int]:
    """The gunicorn workers: children of the `frontend` process (gunicorn's master runs in it)."""
    children = Path(f"/proc/{frontend.pid}/task/{frontend.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


# -- attack 6: a body that outgrows one frame once packed ---------------------------------------
@pytest.mark.parametrize("field", ["chat_template_kwargs", "tools"])
def test_a_request_too_large_for_one_frame_is_413_at_once(frontend: Frontend, model_id: str, field: str) -> None:
    """Before: 0.5-floats pack 2.25 x larger than their JSON; the engine dropped the 36 MB frame unread and
    the client waited for --request-timeout. Now the front-end packs the ADD first and answers 413."""
    floats = [0.5] * 3_800_000  # ~15 MB of JSON, ~34 MB packed: over the 32 MiB frame limit
    extra = ({"chat_template_kwargs": {"values": floats}} if field == "chat_template_kwargs" else
             {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {}, "examples": floats}}}]})
    body = json.dumps({"model": model_id, "messages": HELLO, "max_tokens": 4, **extra}, separators=(",", ":"))
    victim = Victim(frontend, model_id)
    victim.start()
    victim.wait_for_first_chunk()
    response = httpx.post(chat_url(frontend), content=body, headers={"content-type": "application/json"},
                          timeout=120)
    assert response.status_code == 413, response.text
    assert error_of(response)["code"] == "request_too_large"
    victim.join(120)
    assert victim.error is None and victim.finish_reason == "length"
    assert set(inflight_by_worker(frontend).values()) == {0}
    assert_engine_serves(frontend, model_id)


# -- attack 14: unencodable input, overlong names -----------------------------------------------
UNENCODABLE = {
    "surrogate in a message": '"messages": [{"role": "user", "content": "hi \\ud800"}]',
    "surrogate in template kwargs": '"messages": [{"role": "user", "content": "hi"}], '
                                    '"chat_template_kwargs": {"name": "\\udc00"}',
    "integer past 2**64 in a tool": '"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                                    '"function": {"name": "f", "parameters": {"type": "object", '
                                    '"maximum": 100000000000000000000000}}}]',
    "integer under -2**63 in template kwargs": '"messages": [{"role": "user", "content": "hi"}], '
                                               '"chat_template_kwargs": {"n": -9223372036854775809}',
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(UNENCODABLE))
def test_unencodable_input_is_a_400_and_leaves_no_stream_record(frontend: Frontend, model_id: str, case: str,
                                                                stream: bool) -> None:
    """Before: 500, and the worker's stream record leaked (`open_streams` / inflight never returned to 0)."""
    raw = f'{{"model": {json.dumps(model_id)}, "max_tokens": 4, "stream": {json.dumps(stream)}, {UNENCODABLE[case]}}}'
    for _ in range(4):  # both workers
        response = httpx.post(chat_url(frontend), content=raw, headers={"content-type": "application/json"},
                              timeout=60)
        assert response.status_code == 400, response.text
        assert error_of(response)["code"] == "invalid_value"
    assert set(inflight_by_worker(frontend).values()) == {0}
    assert_engine_serves(frontend, model_id)


def test_unencodable_input_on_the_anthropic_route_is_its_400(frontend: Frontend, model_id: str) -> None:
    raw = (f'{{"model": {json.dumps(model_id)}, "max_tokens": 4, "messages": [{{"role": "user", '
           f'"content": "hi \\ud800"}}], "metadata": {{"user_id": "x"}}}}')
    response = httpx.post(f"{frontend.base_url}/v1/messages", content=raw,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    big = httpx.post(f"{frontend.base_url}/v1/messages", timeout=60, json={
        "model": model_id, "max_tokens": 4, "messages": HELLO, "thinking": {"type": "enabled",
                                                                            "budget_tokens": 2**65}})
    assert big.status_code == 400 and big.json()["type"] == "error", big.text
    assert set(inflight_by_worker(frontend).values()) == {0}


@pytest.mark.parametrize("path,extra", [("/v1/chat/completions", {"messages": HELLO}),
                                        ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"}),
                                        ("/v1/tokenize", {"prompt": "hi"})])
def test_model_names_over_255_bytes_are_refused_by_the_front_end(frontend: Frontend, engine: Engine, path: str,
                                                                 extra: dict) -> None:
    name = "front-end-refuses-" + "m" * 300
    response = httpx.post(f"{frontend.base_url}{path}", json={"model": name, "max_tokens": 4, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["code"], error["param"]) == ("invalid_model_name", "model")
    assert "front-end-refuses-" not in engine.log()  # never sent to the engine


# -- attack 5: stop strings ------------------------------------------------------------------------
def test_long_stop_strings_are_refused_by_the_front_end(frontend: Frontend, engine: Engine, model_id: str) -> None:
    stop = "front-end-stop-" + "x" * 1010  # 1025 characters
    response = httpx.post(chat_url(frontend), timeout=60, json={"model": model_id, "messages": HELLO,
                                                                "max_tokens": 4, "stop": ["ok", stop]})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "stop" and "1024 characters" in error["message"]
    anthropic = httpx.post(f"{frontend.base_url}/v1/messages", timeout=60, json={
        "model": model_id, "messages": HELLO, "max_tokens": 4, "stop_sequences": [stop]})
    assert anthropic.status_code == 400 and "1024" in anthropic.json()["error"]["message"]
    within = httpx.post(chat_url(frontend), timeout=60, json={"model": model_id, "messages": HELLO, "max_tokens": 4,
                                                              "stop": ["y" * 1024]})
    assert within.status_code == 200, within.text


def test_chat_template_kwargs_call_arguments_are_refused_by_the_front_end(frontend: Frontend, model_id: str) -> None:
    response = httpx.post(chat_url(frontend), timeout=60, json={
        "model": model_id, "messages": HELLO, "max_tokens": 4,
        "chat_template_kwargs": {"continue_final_message": True, "padding": True}})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "chat_template_kwargs"
    assert "continue_final_message" in error["message"] and "padding" in error["message"]


# -- attack 9: a client that stops reading ------------------------------------------------------------
@pytest.mark.parametrize("choices", [1, 2])
def test_a_client_that_stops_reading_is_cut_off_and_its_worker_stays_small(frontend: Frontend, engine: Engine,
                                                                             model_id: str, choices: int) -> None:
    """Before: with top_logprobs the worker grew ~3 MB/s until max_tokens. Now the stream's unread output is
    capped (--max-pending-bytes, 8 MiB): the client is cut off, the engine aborts its request. With `n` > 1
    the merged body's queue was unbounded (~7 MB/s, never cut off); now it is bounded, so each choice's
    unread output stays in its own stream, under the same cap."""
    log_start = len(frontend.log())
    payload = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "go"}], "max_tokens": 20000,
                          "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True,
                          "top_logprobs": 20, "n": choices}).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", frontend.port))
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    try:
        head = b""
        stalled.settimeout(60)
        while b"\r\n\r\n" not in head:
            head += stalled.recv(1)  # the headers only: from here on, nothing is read
        assert head.startswith(b"HTTP/1.1 200"), head
        rid = re.search(rb"(?im)^x-request-id: (\S+)", head).group(1).decode()
        victim = Victim(frontend, model_id, max_tokens=64)
        victim.start()
        # The engine logs the ABORTs it took together in one line: with `n` > 1 both choices may be in it.
        aborted = re.compile(rf"aborted \d+ request\(s\) \([^)]*slow_client[^)]*\): rid=[^\n]*{re.escape(rid)}")
        peak = 0.0
        deadline = time.monotonic() + 240
        while not aborted.search(engine.log()) and time.monotonic() < deadline:
            peak = max([peak] + [rss_mb(pid) for pid in worker_pids(frontend)])
            time.sleep(0.5)
        assert aborted.search(engine.log()), engine.log()[-3000:]
        for _ in range(6):  # after the cut the memory is freed, not growing on
            peak = max([peak] + [rss_mb(pid) for pid in worker_pids(frontend)])
            time.sleep(0.5)
        assert peak < RSS_CAP_MB, peak
        victim.join(120)
        assert victim.error is None and victim.finish_reason == "length"
    finally:
        stalled.close()
    assert f"rid={rid}: " in frontend.log()[log_start:]  # the worker's warning: "... cutting the client off"
    assert_engine_serves(frontend, model_id)


# -- attack 7: large bodies and the event loop --------------------------------------------------------
def test_large_bodies_do_not_starve_heartbeats_or_other_streams(frontend: Frontend, model_id: str) -> None:
    """Before: a 12-16 MB body blocked its worker's loop for seconds, sending no pings meanwhile; the heartbeat
    then took the quiet for a dead engine and marked it down, and the streams that worker was asked for got
    503 engine_unavailable. Now bodies are parsed one at a time in a parser thread and silence counts only
    from a ping that was really sent. (A worker receiving a steady stream of frames never showed it: the
    victims here are short streams sent one after another, as new requests would be.)"""
    log_start = len(frontend.log())
    nested = json.dumps([[1, [2]]] * 1_300_000, separators=(",", ":"))  # ~13 MB: the slowest kind to parse
    body = json.dumps({"model": model_id, "messages": HELLO, "max_tokens": 0}).encode()[:-1] + \
        b', "filler": ' + nested.encode() + b"}"
    statuses: list[int] = []
    health: list[tuple[int, str]] = []
    streams: list[str] = []  # each victim stream's finish reason, or its error
    done = threading.Event()

    def attack() -> None:
        response = httpx.post(chat_url(frontend), content=body, headers={"content-type": "application/json"},
                              timeout=120)
        statuses.append(response.status_code)

    def watch() -> None:
        while not done.is_set():
            response = httpx.get(f"{frontend.base_url}/health", timeout=30)
            health.append((response.status_code, response.json().get("status")))
            time.sleep(0.1)

    def victims() -> None:
        client = client_for(frontend)
        while not done.is_set():
            try:
                chunks = list(client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4,
                                                             temperature=0, stream=True))
                streams.append(chunks[-1].choices[0].finish_reason)
            except Exception as exc:  # the assertion reports it
                streams.append(repr(exc))
            time.sleep(0.05)

    attackers = [threading.Thread(target=attack) for _ in range(8)]
    helpers = [threading.Thread(target=watch), threading.Thread(target=victims), threading.Thread(target=victims)]
    for thread in helpers + attackers:
        thread.start()
    for thread in attackers:
        thread.join(300)
    time.sleep(1.0)  # a worker marking the engine down would do it within dead_after of its stall
    done.set()
    for thread in helpers:
        thread.join(60)
    assert statuses == [400] * 8
    assert health and all(entry == (200, "healthy") for entry in health), health
    assert len(streams) >= 4 and set(streams) <= {"length", "stop"}, streams
    log = frontend.log()[log_start:]
    assert "marking it down" not in log and "engine_unavailable" not in log
    assert_engine_serves(frontend, model_id)
