"""Two real `engined` behind one gunicorn front-end: affinity, bounded load, failover, draining.

Every assertion is on what the engines and the front-end report (X-Engine-Id,
usage.cached_tokens, engine counters, engine state), never on client clocks: a
phase of a test begins when the front-end says a state was reached.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from http_frontend.engine.routing import affinity_key, rendezvous_order
from tests.helpers import Engine, Frontend, call_engine, one_frontend_for, ping_engine

EPSILON = 0.25
IDS = ("a", "b")


class Pair:
    """Engines `a` and `b` (restartable) and a two-worker front-end routing between them."""

    def __init__(self, model: Path, ipc_dir: Path, logs: Path):
        self.model, self.logs = model, logs
        self.endpoints = {engine_id: f"ipc://{ipc_dir}/route-{engine_id}.sock" for engine_id in IDS}
        self.engines: dict[str, Engine] = {}
        self.starts = Counter()

    def start_engine(self, engine_id: str) -> Engine:
        self.starts[engine_id] += 1
        # 20 conversations per engine stay cached (the default keeps 10 entries).
        engine = Engine(self.endpoints[engine_id], self.logs / f"engined-{engine_id}-{self.starts[engine_id]}.log",
                        model=str(self.model), args=["--prompt-cache-size", "64"])
        self.engines[engine_id] = engine
        engine.wait_ready()
        return engine

    def frontend(self, workers: int, name: str) -> Frontend:
        endpoints = [f"{engine_id}={endpoint}" for engine_id, endpoint in self.endpoints.items()]
        front = Frontend(endpoints[0], self.logs / f"frontend-{name}.log", workers=workers,
                         args=["--endpoint", endpoints[1], "--routing-epsilon", str(EPSILON)])
        front.wait_healthy()
        return front

    def added(self) -> dict[str, int]:
        """Requests each engine admitted so far (its own counter)."""
        return {e: call_engine(self.endpoints[e], "stats")["requests_added"] for e in IDS}


@pytest.fixture(scope="module")
def pair(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    pair = Pair(tiny_model, ipc_dir, tmp_path_factory.mktemp("routing"))
    try:
        for engine_id in IDS:
            pair.start_engine(engine_id)
        yield pair
    finally:
        for engine in pair.engines.values():
            engine.stop()


@pytest.fixture(scope="module")
def front(pair: Pair) -> Iterator[Frontend]:
    front = pair.frontend(2, "shared")
    try:
        yield front
    finally:
        front.stop()


def chat(front: Frontend, messages: list[dict], max_tokens: int = 8, headers: dict | None = None,
         **extra: object) -> httpx.Response:
    return httpx.post(f"{front.base_url}/v1/chat/completions", headers=headers, timeout=60,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})


def stream(front: Frontend, key: str, max_tokens: int, on_headers: Callable[[str], None] | None = None
           ) -> tuple[str, list[dict]]:
    """(X-Engine-Id, data payloads) of one streamed chat request with affinity key `key`."""
    body = {"messages": [{"role": "user", "content": f"Count for {key}."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    events: list[dict] = []
    with httpx.stream("POST", f"{front.base_url}/v1/chat/completions", json=body, timeout=60,
                      headers={"X-Session-Affinity": key}) as response:
        engine_id = response.headers.get("x-engine-id", "")
        if response.status_code != 200:
            return engine_id, [{"error": {"status": response.status_code, "body": response.read().decode()}}]
        if on_headers:
            on_headers(engine_id)
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[6:]
                events.append({"done": True} if payload == "[DONE]" else json.loads(payload))
    return engine_id, events


def failed(events: list[dict]) -> bool:
    return any("error" in e for e in events) or events[-1:] != [{"done": True}]


def engines_view(front: Frontend) -> dict[str, dict]:
    return {e["id"]: e for e in httpx.get(f"{front.base_url}/admin/engines", timeout=10).json()["data"]}


def wait_for(condition: Callable[[], bool], what: str, tries: int = 600) -> None:
    """Polls the front-end / engines until `condition` holds (a bound on tries, not a clock)."""
    done = threading.Event()
    for _ in range(tries):
        if condition():
            return
        done.wait(0.05)
    raise AssertionError(f"never reached: {what}")


def test_conversations_stay_on_their_engine_and_hit_its_cache(pair: Pair, front: Frontend) -> None:
    """40 conversations x 3 turns: every follow-up on the first turn's engine, its prefix cached there."""
    def conversation(index: int) -> list[tuple[str, dict]]:
        messages = [{"role": "system", "content": f"You are assistant number {index}."},
                    {"role": "user", "content": f"Conversation {index}: tell me about the number {index * 7}."}]
        turns = []
        for turn in range(3):
            r = chat(front, messages, max_tokens=8)
            assert r.status_code == 200, r.text
            body = r.json()
            turns.append((r.headers["x-engine-id"], body["usage"]))
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And turn {turn + 2}?"}]
        return turns

    # 4 at a time: never past --routing-min-bound (8), so no conversation is moved for load.
    with ThreadPoolExecutor(4) as pool:
        conversations = list(pool.map(conversation, range(40)))
    first_engines = Counter(turns[0][0] for turns in conversations)
    assert set(first_engines) <= set(IDS)
    for turns in conversations:
        assert {engine for engine, _ in turns} == {turns[0][0]}, turns  # every turn where the first went
        for (_, before), (_, usage) in zip(turns, turns[1:]):
            # The previous turn's prompt is a prefix of this one and that engine has it cached, all but its
            # last token (which an engine always feeds again for the next token's logits).
            assert usage["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"] - 1, (before, usage)
    assert 16 <= first_engines["a"] <= 24, first_engines  # split 40-60 % or better


def test_a_hot_key_burst_spreads_past_the_load_bound(pair: Pair) -> None:
    """64 concurrent requests with one affinity key: the preferred engine takes up to its bound, the other the rest.

    The requests run until the test closes them, so all 64 are open at once whatever the machine's speed; the
    split is read from the front-end's own open streams per engine (one worker: one view) and the engines' PONGs.
    """
    front = pair.frontend(1, "burst")
    stop = threading.Event()

    def endless(index: int) -> str:
        body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 20000, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{front.base_url}/v1/chat/completions", json=body, timeout=120,
                          headers={"X-Session-Affinity": "one-hot-key"}) as response:
            assert response.status_code == 200, response.read()
            for _ in response.iter_lines():
                if stop.is_set():
                    break
            return response.headers["x-engine-id"]

    try:
        with ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(endless, i) for i in range(64)]
            try:
                # 64 client threads and two engines on a loaded 2-core CI machine: 30 s of polls ran out once.
                wait_for(lambda: sum(e["open_streams"] for e in engines_view(front).values()) == 64,
                         "64 requests open", tries=2400)
                view = engines_view(front)
                wait_for(lambda: all(e["queued"] + e["running"] == view[e["id"]]["open_streams"]
                                     for e in engines_view(front).values()), "the engines report the same split")
            finally:
                stop.set()
            headers = Counter(f.result(timeout=120) for f in futures)
        split = {e: view[e]["open_streams"] for e in IDS}
        print(f"hot-key burst split: {split}")
        assert split == {e: headers[e] for e in IDS}  # what each client was told (X-Engine-Id)
        mean = 64 / len(IDS)
        assert min(split.values()) > 0, split  # spread to the second engine
        assert max(split.values()) <= math.ceil((1 + EPSILON) * mean), split
    finally:
        front.stop()


def test_responses_follow_ups_reach_the_engine_that_stores_them(front: Frontend) -> None:
    """A response id names its engine: previous_response_id, GET and DELETE reach it; an unknown engine is a 404."""
    url = f"{front.base_url}/v1/responses"
    for index in range(6):  # different conversations: both engines end up holding some
        first = httpx.post(url, timeout=60, json={"input": f"Story {index}, please.", "max_output_tokens": 6})
        assert first.status_code == 200, first.text
        engine, response_id = first.headers["x-engine-id"], first.json()["id"]
        assert response_id.startswith(f"resp_{engine}_")
        follow = httpx.post(url, timeout=60, json={"input": "Go on.", "max_output_tokens": 6,
                                                   "previous_response_id": response_id})
        assert follow.status_code == 200, follow.text
        assert follow.headers["x-engine-id"] == engine
        assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
        got = httpx.get(f"{url}/{follow.json()['id']}", timeout=10)
        assert got.status_code == 200 and got.headers["x-engine-id"] == engine
    gone = httpx.get(f"{url}/resp_zz_{'0' * 32}", timeout=10)
    assert gone.status_code == 404 and "'zz'" in gone.json()["error"]["message"]


def test_service_routes_cover_every_engine(pair: Pair, front: Frontend) -> None:
    """/health per engine, /v1/models the union, /stats every engine, /metrics labelled by engine."""
    health = httpx.get(f"{front.base_url}/health", timeout=10)
    assert health.status_code == 200
    assert {e["id"]: e["status"] for e in health.json()["engines"]} == {"a": "healthy", "b": "healthy"}
    models = httpx.get(f"{front.base_url}/v1/models", timeout=30).json()["data"]
    ids = [m["id"] for m in models]
    assert str(pair.model) in ids and len(ids) == len(set(ids))
    stats = httpx.get(f"{front.base_url}/stats", timeout=10).json()
    assert [e["id"] for e in stats["engines"]] == ["a", "b"] and all("requests_added" in e for e in stats["engines"])
    metrics = httpx.get(f"{front.base_url}/metrics", timeout=10).text
    assert 'mlx_engine_up{engine="a"} 1' in metrics and 'mlx_engine_up{engine="b"} 1' in metrics
    assert metrics.count("# TYPE mlx_engine_up ") == 1  # one family, two series
    assert 'mlx_engine_requests_total{engine="b",outcome="added"}' in metrics


def test_engine_drain_signals_reach_the_pongs(pair: Pair) -> None:
    """SIGUSR1 drains the engine (every front-end reads `draining` in its PONG), SIGUSR2 ends it."""
    pair.engines["b"].signal(signal.SIGUSR1)
    wait_for(lambda: (ping_engine(pair.endpoints["b"]) or {}).get("state") == "draining", "b draining")
    pair.engines["b"].signal(signal.SIGUSR2)
    wait_for(lambda: (ping_engine(pair.endpoints["b"]) or {}).get("state") == "ready", "b ready again")


def test_drain_under_load_fails_nothing(pair: Pair) -> None:
    """Drain `a` while 16 clients stream: its open streams finish, new ones go to `b`, nothing fails."""
    front = pair.frontend(1, "drain")
    try:
        results: list[tuple[str, list[dict], str]] = []
        phase = ["before"]
        stop = threading.Event()
        a_open = threading.Semaphore(0)

        def client(index: int) -> None:
            n = 0
            while not stop.is_set():
                started_in = phase[0]

                def on_headers(engine_id: str) -> None:
                    if engine_id == "a":
                        a_open.release()

                engine, events = stream(front, f"drain-{index}-{n}", 48, on_headers)
                results.append((engine, events, started_in))
                n += 1

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(client, i) for i in range(16)]
            assert a_open.acquire(timeout=60)  # a stream on `a` is open
            r = httpx.post(f"{front.base_url}/admin/engines/a/drain", timeout=10)
            assert r.status_code == 200 and r.json()["state"] == "draining", r.text
            wait_for(lambda: call_engine(pair.endpoints["a"], "status")["state"] == "draining", "engine draining")
            phase[0] = "drained"
            wait_for(lambda: sum(1 for e, _, p in results if p == "drained") >= 32, "32 requests after the drain")
            stop.set()
            for future in futures:
                future.result(timeout=120)
        assert not [events for _, events, _ in results if failed(events)]  # 0 failed, in-flight ones included
        assert any(engine == "a" for engine, _, p in results if p == "before")
        assert {engine for engine, _, p in results if p == "drained"} == {"b"}
        assert call_engine(pair.endpoints["a"], "status")["running"] == 0  # its streams ran to their end
        assert httpx.get(f"{front.base_url}/health", timeout=10).status_code == 200
    finally:
        httpx.post(f"{front.base_url}/admin/engines/a/undrain", timeout=10)
        front.stop()
    wait_for(lambda: call_engine(pair.endpoints["a"], "status")["state"] == "ready", "engine a undrained")


def test_kill_9_under_load_fails_only_its_streams_and_it_rejoins(pair: Pair) -> None:
    """kill -9 of `a` under 16 streaming clients: its streams end with an error event, later requests all
    succeed on `b`, and the restarted `a` gets new conversations."""
    front = pair.frontend(1, "kill")
    try:
        results: list[tuple[str, list[dict], str]] = []
        phase = ["before"]
        stop = threading.Event()
        ended: dict[int, float] = {}
        a_open = threading.Semaphore(0)
        # Streams that run until the engine dies, on keys whose rendezvous order starts with `a`.
        keys_on_a = [key for key in (f"long-{i}" for i in range(100))
                     if rendezvous_order(affinity_key({"x-session-affinity": key}), IDS)[0] == "a"][:4]

        def long_stream(key: str) -> tuple[str, list[dict]]:
            engine, events = stream(front, key, 20000, lambda engine_id: a_open.release())
            ended[id(events)] = time.monotonic()
            return engine, events

        def client(index: int) -> None:
            n = 0
            while not stop.is_set():
                started_in = phase[0]
                engine, events = stream(front, f"kill-{index}-{n}", 96)
                results.append((engine, events, started_in))
                n += 1

        with ThreadPoolExecutor(20) as pool:
            longs = [pool.submit(long_stream, key) for key in keys_on_a]
            for _ in keys_on_a:
                assert a_open.acquire(timeout=60)  # the long streams are open (on `a`: checked below)
            futures = [pool.submit(client, i) for i in range(16)]
            wait_for(lambda: len(results) >= 16, "the loop is running")
            killed_at = time.monotonic()
            pair.engines["a"].signal(signal.SIGKILL)
            pair.engines["a"].popen.wait(10)
            phase[0] = "killed"
            wait_for(lambda: engines_view(front)["a"]["state"] == "unreachable", "the front-end notices")
            phase[0] = "noticed"
            wait_for(lambda: sum(1 for _, _, p in results if p == "noticed") >= 32, "32 requests after")
            stop.set()
            for future in futures:
                future.result(timeout=120)
            broken = [future.result(timeout=60) for future in longs]
        assert {engine for engine, _ in broken} == {"a"}
        for _, events in broken:  # an error event, then [DONE]
            assert events[-1] == {"done": True} and "error" in events[-2], events[-3:]
            assert events[-2]["error"]["code"] in ("engine_unavailable", "engine_restarted")
        print(f"kill -9: {len(broken)} long stream(s) on a ended with an error event, the last "
              f"{max(ended[id(e)] for _, e in broken) - killed_at:.2f} s after the kill (client clock)")
        assert not [events for engine, events, p in results if engine == "b" and failed(events)]
        after = [(engine, events) for engine, events, p in results if p == "noticed"]
        assert not [events for _, events in after if failed(events)]  # 0 failed after the kill was noticed
        assert {engine for engine, _ in after} == {"b"}
        print(f"kill -9: {len(after)} requests after the front-end noticed, 0 failed; "
              f"{sum(1 for _, _, p in results if p == 'killed')} started between the kill and the notice, "
              f"{sum(1 for _, e, p in results if p == 'killed' and failed(e))} of them failed")
        health = httpx.get(f"{front.base_url}/health", timeout=10).json()
        assert {e["id"]: e["status"] for e in health["engines"]} == {"a": "unhealthy", "b": "healthy"}

        pair.start_engine("a")
        wait_for(lambda: engines_view(front)["a"]["routable"], "the restarted engine rejoins")
        landed = Counter(stream(front, f"rejoin-{i}", 4)[0] for i in range(20))
        assert landed["a"] > 0 and landed["b"] > 0, landed
    finally:
        front.stop()


def test_requests_sent_to_a_freezing_engine_are_served_by_the_other(pair: Pair) -> None:
    """Red team: behind two engines, requests routed to one that had just frozen (SIGSTOP) waited ~2 s and got
    503 engine_unavailable. Not yet accepted, nothing generated: they pass to the other engine instead."""
    front = pair.frontend(1, "freeze")
    keys_on_a = [key for key in (f"freeze-{i}" for i in range(100))
                 if rendezvous_order(affinity_key({"x-session-affinity": key}), IDS)[0] == "a"][:4]
    try:
        pair.engines["a"].signal(signal.SIGSTOP)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda key: chat(front, [{"role": "user", "content": f"hi {key}"}],
                                                     headers={"X-Session-Affinity": key}), keys_on_a))
        assert [reply.status_code for reply in replies] == [200] * 4, [reply.text for reply in replies]
        assert {reply.headers["x-engine-id"] for reply in replies} == {"b"}
    finally:
        pair.engines["a"].signal(signal.SIGCONT)
        wait_for(lambda: engines_view(front)["a"]["state"] == "ready", "a answers again")
        front.stop()


def test_unload_reaches_every_engine_when_one_cannot(pair: Pair, front: Frontend) -> None:
    """Red team: the first engine's refusal (a group's 400, or an engine down) ended POST /unload: the engines
    after it stayed loaded. Each engine now answers for itself. (Last here: it stops `b`, then restarts it.)"""
    pair.engines["b"].stop()
    try:
        answer = httpx.post(f"{front.base_url}/unload", timeout=120)
        assert answer.status_code == 200, answer.text
        engines = answer.json()["engines"]
        assert engines["a"] == {"status": "success"}, engines
        assert engines["b"]["error"]["code"] in ("engine_unavailable", "engine_restarted"), engines
        assert call_engine(pair.endpoints["a"], "status")["model"] is None  # unloaded, though `b` could not be
    finally:
        pair.start_engine("b")


def test_a_model_whose_engine_is_down_gets_a_503_not_another_engines_400(
        tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Red team: with the engine serving model B down, requests for B went to the engine serving A, which cannot
    load it: a 400 `invalid_model_name` a client does not retry. It is the engine's outage: 503, Retry-After."""
    from model_builders.text import build_model

    logs = tmp_path_factory.mktemp("routing-models")
    other = build_model(logs / "tiny-other", size="tiny", seed=5)
    endpoints = {"a": f"ipc://{ipc_dir}/models-a.sock", "b": f"ipc://{ipc_dir}/models-b.sock"}
    engines = {"a": Engine(endpoints["a"], logs / "a.log", model=str(tiny_model)),
               "b": Engine(endpoints["b"], logs / "b.log", model=str(other))}
    with one_frontend_for(engines, logs / "frontend.log") as front:
        wait_for(lambda: engines_view(front)["b"]["model"] == str(other), "b reports its model")
        engines["b"].stop()
        wait_for(lambda: not engines_view(front)["b"]["routable"], "the front-end sees b down")
        answer = httpx.post(f"{front.base_url}/v1/chat/completions", timeout=60, json={
            "model": str(other), "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 503 and answer.headers.get("retry-after"), answer.text
        assert answer.json()["error"]["code"] == "engine_unavailable"
