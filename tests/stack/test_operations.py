"""Operations through real processes: model catalogue, front-end restarts, client disconnects."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Engine, Frontend


def stats(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def test_models_lists_mlx_models_of_the_hf_cache(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    from model_builders.hf_cache import place_in_hf_cache

    cache = tmp_path / "hub"
    place_in_hf_cache(tiny_model, "mlx-community/tiny-random-qwen2", cache)
    not_mlx = tmp_path / "not-mlx"
    not_mlx.mkdir()
    (not_mlx / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (not_mlx / "pytorch_model.bin").write_bytes(b"\0" * 16)
    place_in_hf_cache(not_mlx, "someone/pytorch-only", cache)

    # Requests may name local paths only inside a --model-dir root. The root is the model directory itself,
    # so str(tiny_model) is allowed while /v1/models (which lists models *under* roots) shows only the cache.
    engine = Engine(f"ipc://{ipc_dir}/hf.sock", tmp_path / "engined.log", env={"HF_HUB_CACHE": str(cache)},
                    args=["--model-dir", str(tiny_model)])
    frontend = Frontend(engine.endpoint, tmp_path / "frontend.log", workers=1)
    try:
        engine.wait_ready(model_loaded=False)
        assert frontend.wait_healthy()["loaded_model"] is None
        listed = httpx.get(f"{frontend.base_url}/v1/models", timeout=30).json()
        ids = [m["id"] for m in listed["data"]]
        assert ids == ["mlx-community/tiny-random-qwen2"]
        assert listed["data"][0]["object"] == "model" and listed["data"][0]["loaded"] is False

        client = openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="x", max_retries=0)
        ids_via_sdk = [m.id for m in client.models.list()]
        assert ids_via_sdk == ids
        reply = client.chat.completions.create(model="mlx-community/tiny-random-qwen2", max_tokens=8,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.model == "mlx-community/tiny-random-qwen2"
        assert httpx.get(f"{frontend.base_url}/health").json()["loaded_model"] == "mlx-community/tiny-random-qwen2"
        assert httpx.get(f"{frontend.base_url}/v1/models").json()["data"][0]["loaded"] is True
        # A request naming another model evicts the loaded one: one model in memory at a time.
        other = client.chat.completions.create(model=str(tiny_model), max_tokens=4,
                                               messages=[{"role": "user", "content": "hi"}])
        assert other.model == str(tiny_model)
        health = httpx.get(f"{frontend.base_url}/health").json()
        assert health["loaded_model"] == str(tiny_model) and health["engine"]["model_loads"] == 2
        listed = httpx.get(f"{frontend.base_url}/v1/models").json()["data"]
        assert {m["id"]: m["loaded"] for m in listed} == {str(tiny_model): True,
                                                          "mlx-community/tiny-random-qwen2": False}
        assert httpx.post(f"{frontend.base_url}/unload").json() == {"status": "success"}
        assert httpx.post(f"{frontend.base_url}/unload").json() == {"status": "no_model_loaded"}
        assert httpx.get(f"{frontend.base_url}/health").json()["loaded_model"] is None
    finally:
        frontend.stop()
        engine.stop()


def _chat_ok(frontend: Frontend, model_id: str) -> str:
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30, json={
        "model": model_id, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_frontend_restarts_and_reloads_without_model_reload(engine: Engine, model_id: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "gunicorn.pid"
    frontend = Frontend(engine.endpoint, tmp_path / "fe1.log", workers=2, pid_file=pid_file)
    try:
        frontend.wait_healthy()
        # The shared engine may hold another model from earlier tests: load this one first.
        first = _chat_ok(frontend, model_id)
        before = httpx.get(f"{frontend.base_url}/health").json()["engine"]
        loads_logged = engine.log().count("loading model")
    finally:
        frontend.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{frontend.base_url}/health", timeout=2)

    frontend = Frontend(engine.endpoint, tmp_path / "fe2.log", port=frontend.port, workers=2, pid_file=pid_file)
    try:
        after = frontend.wait_healthy()["engine"]
        assert _chat_ok(frontend, model_id) == first
        # HUP: gunicorn replaces its workers; the new ones reconnect to the same engine.
        old_workers = set(_worker_pids(frontend))
        os.kill(int(pid_file.read_text()), signal.SIGHUP)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and set(_worker_pids(frontend)) & old_workers:
            time.sleep(0.2)
        assert not set(_worker_pids(frontend)) & old_workers, "HUP did not replace the workers"
        frontend.wait_healthy()
        assert _chat_ok(frontend, model_id) == first
        reloaded = httpx.get(f"{frontend.base_url}/health").json()["engine"]
    finally:
        frontend.stop()
    assert before["epoch"] == after["epoch"] == reloaded["epoch"]
    assert before["pid"] == after["pid"] == reloaded["pid"]
    assert reloaded["uptime"] > before["uptime"]
    assert before["model_loads"] == after["model_loads"] == reloaded["model_loads"] >= 1
    assert engine.log().count("loading model") == loads_logged


def _worker_pids(frontend: Frontend) -> list[int]:
    """Children of the gunicorn master (its workers)."""
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(frontend.pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_client_disconnect_aborts_generation(engine: Engine, frontend: Frontend, model_id: str) -> None:
    before = stats(frontend)
    body = {"model": model_id, "max_tokens": 3000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Go on forever."}]}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{frontend.base_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(5):
                next(lines)
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 120  # a bound on the wait, not a speed: the counters below are the check
    while time.monotonic() < deadline:
        now = stats(frontend)
        if now["requests_aborted"] > before["requests_aborted"] and now["running"] == 0:
            break
        time.sleep(0.05)
    assert now["requests_aborted"] == before["requests_aborted"] + 1
    assert now["running"] == 0 and now["queued"] == 0
    assert now["tokens_generated"] - before["tokens_generated"] < 3000
    assert "aborted 1 request(s) (client_disconnected)" in engine.log()

    with httpx.Client(timeout=60) as http:  # the engine takes the next request (nothing of the aborted one left)
        answer = http.post(f"{frontend.base_url}/v1/chat/completions", json={**body, "max_tokens": 4, "stream": False})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 4


def test_engine_unreachable_gives_503(tmp_path: Path, ipc_dir: Path) -> None:
    frontend = Frontend(f"ipc://{ipc_dir}/nobody.sock", tmp_path / "frontend.log", workers=1)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                health = httpx.get(f"{frontend.base_url}/health", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=10,
                       json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "engine_unavailable"
    finally:
        frontend.stop()


def test_the_engine_reports_its_cpu_streams(frontend: Frontend) -> None:
    stats = httpx.get(f"{frontend.base_url}/stats").json()
    assert stats["cpu_parallel_ops"] == min(os.cpu_count() or 1, 8)
    assert stats["cpu_prefill_attention"] == "numpy"  # the default on the CPU (`--cpu-prefill-attention`)
    assert stats["cpu_prefill_swiglu"] == "numpy"  # likewise (`--cpu-prefill-swiglu`)
    assert stats["cpu_decode_attention"] == "numpy"  # long-context decode steps (`--cpu-decode-attention`)
