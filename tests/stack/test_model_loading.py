"""Loading policy through real processes: preload from the environment, offline first, loading
progress in /health, requests that wait for a load, and --idle-unload.

The engine preloads a model of a dedicated HF cache named by PRELOAD_MODEL (mlx_lm/mlx_vlm
servers' variable). HF_HUB_OFFLINE is not set, and HF_ENDPOINT points at a local socket that
counts connections: a cached model must load without a single one. Fault injection delays
every load by LOAD_DELAY seconds so that /health can be seen reporting it, and requests
arriving meanwhile have to wait for it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from model_builders.hf_cache import place_in_hf_cache
from tests.helpers import Engine, Frontend

REPO = "mlx-community/tiny-offline"
LOAD_DELAY, IDLE_UNLOAD = 1.5, 2.0


class ConnectionCounter:
    """A listening socket standing in for the Hub: every connection to it is counted (and closed)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture(scope="module")
def hub() -> Iterator[ConnectionCounter]:
    counter = ConnectionCounter()
    try:
        yield counter
    finally:
        counter.close()


@pytest.fixture(scope="module")
def served(tiny_model: Path, ipc_dir: Path, hub: ConnectionCounter,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Frontend]]:
    base = tmp_path_factory.mktemp("loading")
    place_in_hf_cache(tiny_model, REPO, base / "hub")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MLX_ENGINE_MODEL"):
            patch.delenv(name, raising=False)
        engine = Engine(f"ipc://{ipc_dir}/loading.sock", base / "engined.log",
                        args=["--idle-unload", str(IDLE_UNLOAD)],
                        env={"PRELOAD_MODEL": REPO, "HF_HUB_CACHE": str(base / "hub"),
                             "HF_ENDPOINT": f"http://127.0.0.1:{hub.port}",
                             "MLX_ENGINE_FAULT_INJECTION": "1", "MLX_ENGINE_DEBUG_LOAD_SECONDS": str(LOAD_DELAY)})
    frontend = Frontend(engine.endpoint, base / "frontend.log", workers=1)
    try:
        engine.wait_ready(model_loaded=False)
        frontend.wait_healthy()
        yield engine, frontend
    finally:
        frontend.stop()
        engine.stop()


def health(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/health", timeout=10).json()


def wait_for(condition, timeout: float, what: str) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def chat(frontend: Frontend, model: str | None = REPO) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    if model:
        body["model"] = model
    return httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json=body)


def test_preload_from_the_environment(served: tuple[Engine, Frontend]) -> None:
    engine, frontend = served
    # PRELOAD_MODEL, no --model: the engine loads it at start (slowed by LOAD_DELAY).
    loaded = wait_for(lambda: (lambda h: h if h["loaded_model"] == REPO else None)(health(frontend)),
                      LOAD_DELAY * 4, "the preloaded model")
    assert loaded["engine"]["state"] == "ready" and loaded["engine"]["loading_model"] is None
    assert loaded["engine"]["model_loads"] == 1
    log = engine.log()
    assert f"loading model {REPO} from " in log and f"loaded model {REPO} in" in log


def test_a_cached_model_loads_without_any_network_attempt(served: tuple[Engine, Frontend],
                                                          hub: ConnectionCounter) -> None:
    engine, frontend = served
    r = chat(frontend)
    assert r.status_code == 200 and r.json()["model"] == REPO, r.text
    # A model that is not cached: 404 at once, still without asking the Hub (downloads are off).
    r = chat(frontend, "mlx-community/not-cached")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert hub.connections == 0
    log = engine.log()
    for symptom in ("Retrying", "ConnectionError", "Max retries", "Traceback", "offline mode"):
        assert symptom not in log
    load_seconds = [float(line.split(" in ")[1].split(" s")[0]) for line in log.splitlines()
                    if f"loaded model {REPO} in" in line]
    assert load_seconds and max(load_seconds) < 5.0, load_seconds  # the load itself, without the injected delay


def test_idle_unload_frees_the_model_and_the_next_requests_wait_for_one_load(
        served: tuple[Engine, Frontend]) -> None:
    engine, frontend = served
    assert chat(frontend).status_code == 200
    loads = health(frontend)["engine"]["model_loads"]
    unloaded = wait_for(lambda: (lambda h: h if h["loaded_model"] is None else None)(health(frontend)),
                        IDLE_UNLOAD + 5, "the idle unload")
    assert unloaded["engine"]["state"] == "idle" and unloaded["engine"]["model_loads"] == loads
    assert f"model {REPO} unused for" in engine.log()
    # Several requests at once: all wait for the one (slow) load instead of failing, the last one
    # without a 'model' too (the preloaded model is the default). Meanwhile /health shows the load.
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(chat, frontend, model) for model in (REPO, REPO, REPO, None)]
        seen = wait_for(lambda: (lambda h: h if h["engine"]["state"] == "loading" else None)(health(frontend)),
                        LOAD_DELAY * 2, "state loading")
        time.sleep(0.5)
        later = health(frontend)
        replies = [future.result() for future in pending]
    assert seen["status"] == "healthy" and seen["loaded_model"] is None
    assert seen["engine"]["loading_model"] == REPO and 0 <= seen["engine"]["loading_seconds"] < LOAD_DELAY + 2
    if later["engine"]["state"] == "loading":  # the load outlasted the pause: its clock moved on
        assert later["engine"]["loading_seconds"] > seen["engine"]["loading_seconds"]
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    assert {r.json()["model"] for r in replies} == {REPO}
    assert time.monotonic() - started >= LOAD_DELAY
    after = health(frontend)
    assert after["loaded_model"] == REPO and after["engine"]["model_loads"] == loads + 1
    stats = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
    assert stats["model_loads"] == loads + 1


