"""Fault injection against real processes: engine death, stalls, front-end restarts, mass disconnects."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.helpers import Engine, Frontend, call_engine


def stream_events(base_url: str, body: dict, on_first=None) -> tuple[list[dict], float]:
    """All `data:` payloads of one streamed chat request, and when the stream ended."""
    events = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[6:]
                events.append({"done": True} if payload == "[DONE]" else json.loads(payload))
                if on_first and len(events) == 2:
                    on_first()
    return events, time.monotonic()


def long_body(model: str = "default", max_tokens: int = 5000) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Talk for a long time."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}


def test_engine_kill_ends_every_stream_and_frontends_reconnect(tiny_model: Path, ipc_dir: Path,
                                                               tmp_path: Path) -> None:
    endpoint = f"ipc://{ipc_dir}/kill.sock"
    engine = Engine(endpoint, tmp_path / "engined-1.log", model=str(tiny_model))
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=2)
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        started = threading.Barrier(9)

        def non_streamed() -> httpx.Response:
            return httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30,
                              json={**long_body(), "stream": False})

        with ThreadPoolExecutor(9) as pool:
            futures = [pool.submit(stream_events, frontend.base_url, long_body(), started.wait) for _ in range(8)]
            started.wait(timeout=30)  # all 8 streams are flowing
            waiting = pool.submit(non_streamed)
            time.sleep(0.3)
            killed_at = time.monotonic()
            engine.signal(signal.SIGKILL)
            results = [f.result(timeout=30) for f in futures]
            in_flight = waiting.result(timeout=30)
        assert in_flight.status_code == 503, in_flight.text
        assert in_flight.json()["error"]["code"] in ("engine_unavailable", "engine_restarted")
        for events, ended_at in results:
            assert ended_at - killed_at < 3.0, f"a stream took {ended_at - killed_at:.1f} s to end"
            assert "error" in events[-2] and events[-1] == {"done": True}
            assert events[-2]["error"]["code"] in ("engine_unavailable", "engine_restarted")
        health = httpx.get(f"{frontend.base_url}/health", timeout=10)
        assert health.status_code == 503
        r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"

        engine = Engine(endpoint, tmp_path / "engined-2.log", model=str(tiny_model))
        engine.wait_ready()
        deadline = time.monotonic() + 10
        while httpx.get(f"{frontend.base_url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "front-end did not reconnect to the new engine"
            time.sleep(0.1)
        r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200
    finally:
        frontend.stop()
        engine.stop()


def test_a_wedged_engine_is_reported_stalled_not_dead(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{ipc_dir}/stall.sock"
    engine = Engine(endpoint, tmp_path / "engined.log", model=str(tiny_model), args=["--stall-timeout", "1"],
                    env={"MLX_ENGINE_FAULT_INJECTION": "1"})
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=1)
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        sleeper = threading.Thread(target=call_engine, args=(endpoint, "debug_sleep", {"seconds": 4}))
        sleeper.start()
        time.sleep(2.0)
        health = httpx.get(f"{frontend.base_url}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["status"] == "stalled" and health.json()["engine"]["busy_seconds"] > 1
        sleeper.join(10)
        time.sleep(0.5)
        assert httpx.get(f"{frontend.base_url}/health", timeout=10).json()["status"] == "healthy"
    finally:
        frontend.stop()
        engine.stop()


def test_gunicorn_reload_and_restart_under_load_lose_no_request(engine: Engine, model_id: str,
                                                                tmp_path: Path) -> None:
    pid_file = tmp_path / "gunicorn.pid"
    frontend = Frontend(engine.endpoint, tmp_path / "fe1.log", workers=2, pid_file=pid_file,
                        args=["--graceful-timeout", "20"])
    frontend.wait_healthy()
    # The shared engine may hold another model from earlier tests: load this one before counting loads.
    httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model_id, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
    epoch = httpx.get(f"{frontend.base_url}/health").json()["engine"]["epoch"]
    loads_logged = engine.log().count("loading model")
    outcomes: list[tuple[float, bool, str]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                events, _ = stream_events(frontend.base_url, {**long_body(model_id, 24), "ignore_eos": True})
                ok = events[-1] == {"done": True} and events[-2]["choices"][0]["finish_reason"] == "length"
                outcomes.append((started, ok, "" if ok else str(events[-2])))
            except httpx.HTTPError as exc:
                outcomes.append((started, False, repr(exc)))
                time.sleep(0.05)

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        os.kill(int(pid_file.read_text()), signal.SIGHUP)  # graceful reload: new workers, old ones drain
        time.sleep(3)
        reloaded_at = time.monotonic()
        time.sleep(2)
        frontend.stop()  # full stop / start on the same port
        frontend = Frontend(engine.endpoint, tmp_path / "fe2.log", port=frontend.port, workers=2,
                            pid_file=pid_file)
        frontend.wait_healthy()
        restarted_at = time.monotonic()
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        frontend.stop()
    after_reload = [o for o in outcomes if reloaded_at <= o[0] and o[0] < restarted_at - 10]
    after_restart = [o for o in outcomes if o[0] >= restarted_at]
    assert after_restart and all(ok for _, ok, _ in after_restart), [o for o in after_restart if not o[1]][:3]
    assert all(ok for _, ok, _ in after_reload)
    assert sum(ok for _, ok, _ in outcomes) > 50
    assert call_engine(engine.endpoint, "status")["epoch"] == epoch
    assert engine.log().count("loading model") == loads_logged


def test_fifty_clients_vanishing_free_the_engine_at_once(engine: Engine, frontend: Frontend, model_id: str) -> None:
    before = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
    log_start = len(engine.log())
    def start_and_vanish(_: int) -> None:
        with httpx.stream("POST", f"{frontend.base_url}/v1/chat/completions", json=long_body(model_id, 3000),
                          timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)

    def start_queued_and_vanish(_: int) -> None:
        # Some of the 50 wait for a batch slot when they leave: they must be dropped too.
        try:
            httpx.post(f"{frontend.base_url}/v1/chat/completions", json={**long_body(model_id, 3000),
                       "stream": False}, timeout=0.5)
        except httpx.TimeoutException:
            pass

    with ThreadPoolExecutor(50) as pool:
        list(pool.map(lambda i: start_and_vanish(i) if i < 32 else start_queued_and_vanish(i), range(50)))
    deadline = time.monotonic() + 120  # a bound on the wait: the engine's counters below are the check
    while True:
        stats = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
        if stats["running"] == 0 and stats["queued"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["queued"] == 0, stats
    # Each of the 32 streams (accepted: each read a few lines) was aborted, and no request ran to its 3,000 tokens
    # (a queued one whose client left before its worker sent it never reached the engine at all).
    assert stats["requests_aborted"] - before["requests_aborted"] >= 32, stats
    assert "completion_tokens=3000" not in engine.log()[log_start:]


def test_a_second_engine_cannot_steal_the_ipc_path(engine: Engine, tmp_path: Path) -> None:
    socket_dir = Path(engine.endpoint[len("ipc://"):]).parent
    assert socket_dir.stat().st_mode & 0o777 == 0o700, "the ipc directory must be private to its user"
    intruder = Engine(engine.endpoint, tmp_path / "intruder.log")
    assert intruder.popen.wait(60) != 0
    assert "another engine is bound" in intruder.log()
    assert call_engine(engine.endpoint, "status")["state"] == "ready"  # the first one still serves


def engine_counter(endpoint: str, name: str) -> int:
    return call_engine(endpoint, "stats")[name]


def wait_for(predicate, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_a_frozen_engine_stops_what_its_clients_gave_up_on(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """Red team: SIGSTOP under streams ended them with engine_unavailable, but after SIGCONT the engine ran them
    on to max_tokens (the front-end never sent ABORT), and a CALL in flight waited for its full timeout."""
    endpoint = f"ipc://{ipc_dir}/freeze.sock"
    engine = Engine(endpoint, tmp_path / "engined.log", model=str(tiny_model))
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=1)
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        aborted_before = engine_counter(endpoint, "requests_aborted")
        started = threading.Barrier(4)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream_events, frontend.base_url, long_body(max_tokens=20_000), started.wait)
                       for _ in range(3)]
            started.wait(timeout=30)
            engine.signal(signal.SIGSTOP)
            models = pool.submit(httpx.get, f"{frontend.base_url}/v1/models", timeout=120)
            results = [f.result(timeout=60) for f in futures]
            listed = models.result(timeout=120)
        for events, _ in results:
            assert events[-2]["error"]["code"] == "engine_unavailable", events[-2]
        # failed with the streams, not after list_models' own 30 s timeout
        assert listed.status_code == 503 and "did not answer" not in listed.text, listed.text
        engine.signal(signal.SIGCONT)
        assert wait_for(lambda: engine_counter(endpoint, "requests_aborted") == aborted_before + 3), engine.log()
        assert call_engine(endpoint, "status")["running"] == 0
    finally:
        engine.signal(signal.SIGCONT)
        frontend.stop()
        engine.stop()


def test_a_paused_worker_hears_that_the_engine_dropped_its_requests(tiny_model: Path, ipc_dir: Path,
                                                                      tmp_path: Path) -> None:
    """Red team: a worker silent past --peer-timeout had its requests aborted by the engine, but nobody told it:
    its clients waited for --request-timeout (600 s). Now its next frame gets a `frontend_dropped` ERROR."""
    endpoint = f"ipc://{ipc_dir}/pause.sock"
    engine = Engine(endpoint, tmp_path / "engined.log", model=str(tiny_model), args=["--peer-timeout", "2"])
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=1, args=["--request-timeout", "600"])
    worker_pid = None
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        (worker_pid,) = {int(line.split("(pid ")[1].split()[0]) for line in engine.log().splitlines()
                         if "connected (pid" in line}
        aborted_before = engine_counter(endpoint, "requests_aborted")
        started = threading.Barrier(3)
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(stream_events, frontend.base_url, long_body(max_tokens=20_000), started.wait)
                       for _ in range(2)]
            started.wait(timeout=30)
            os.kill(worker_pid, signal.SIGSTOP)
            assert wait_for(lambda: engine_counter(endpoint, "requests_aborted") == aborted_before + 2), engine.log()
            os.kill(worker_pid, signal.SIGCONT)
            results = [f.result(timeout=120) for f in futures]  # 600 s before the fix: this times out
        for events, _ in results:
            assert events[-2]["error"]["code"] == "engine_unavailable", events[-2]
            assert "stopped this front-end" in events[-2]["error"]["message"]
        reply = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text  # the worker serves on
    finally:
        if worker_pid is not None:
            os.kill(worker_pid, signal.SIGCONT)
        frontend.stop()
        engine.stop()


SHUTDOWN_BODIES = {
    "/v1/chat/completions": long_body(),
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 5000, "temperature": 0, "stream": True,
                        "ignore_eos": True},
    "/v1/responses": {"input": "Talk for a long time.", "max_output_tokens": 5000, "temperature": 0, "stream": True,
                      "ignore_eos": True},
    "/v1/messages": {"model": "default", "messages": [{"role": "user", "content": "Talk for a long time."}],
                     "max_tokens": 5000, "temperature": 0, "stream": True, "ignore_eos": True},
}


def test_sigterm_tells_every_stream_the_engine_is_shutting_down(tiny_model: Path, ipc_dir: Path,
                                                                 tmp_path: Path) -> None:
    """Red team E4: on SIGTERM the engine sent nothing; every stream ended ~2 s later with "The engine stopped
    responding". Now each open request gets a 503 engine_shutting_down ERROR before the engine exits."""
    endpoint = f"ipc://{ipc_dir}/term.sock"
    engine = Engine(endpoint, tmp_path / "engined.log", model=str(tiny_model))
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=1)
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        started = threading.Barrier(len(SHUTDOWN_BODIES) + 1)

        def stream(path: str, body: dict) -> tuple[list[str], float]:
            lines: list[str] = []
            with httpx.stream("POST", frontend.base_url + path, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 6:
                            started.wait(30)
            return lines, time.monotonic()

        with ThreadPoolExecutor(len(SHUTDOWN_BODIES)) as pool:
            futures = {path: pool.submit(stream, path, body) for path, body in SHUTDOWN_BODIES.items()}
            started.wait(timeout=30)
            stopped_at = time.monotonic()
            engine.signal(signal.SIGTERM)
            results = {path: future.result(timeout=60) for path, future in futures.items()}
        for path, (lines, ended_at) in results.items():
            tail = "\n".join(lines[-4:])
            assert "engine_shutting_down" in tail or "shutting down" in tail, (path, tail)
            assert "stopped responding" not in tail, (path, tail)
            assert ended_at - stopped_at < 1.5, f"{path} ended {ended_at - stopped_at:.1f} s after SIGTERM"
        assert results["/v1/chat/completions"][0][-1] == "data: [DONE]"
        assert engine.popen.wait(30) == 0
    finally:
        frontend.stop()
        engine.stop()
