"""Admission control before the first token: memory budget, context window, queue bound."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, running_stack


@pytest.fixture(scope="module")
def strict_stack(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    """One request decodes at a time, one may wait, and memory is budgeted at 10 MB."""
    logs = tmp_path_factory.mktemp("strict")
    with running_stack(f"ipc://{ipc_dir}/strict.sock", logs, model=str(tiny_model), workers=2,
                       engine_args=["--decode-concurrency", "1", "--prompt-concurrency", "1", "--max-queued", "1",
                                    "--memory-budget", "0.01", "--max-tokens-overflow", "error"]) as (_, frontend):
        yield frontend


def post(frontend: Frontend, **body) -> httpx.Response:
    payload = {"model": "default", "messages": [{"role": "user", "content": "hello there"}], **body}
    return httpx.post(f"{frontend.base_url}/v1/chat/completions", json=payload, timeout=60)


def wait_for(frontend: Frontend, condition, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(f"{frontend.base_url}/stats", timeout=5).json()
        if condition(stats):
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine never reached the expected state: {stats}")


def test_over_budget_and_over_context_get_400_and_a_full_queue_429(strict_stack: Frontend) -> None:
    frontend = strict_stack
    long = {"max_tokens": 2500, "temperature": 0, "ignore_eos": True}
    reference = post(frontend, **long).json()["choices"][0]["message"]["content"]

    running: list[str] = []
    first = threading.Thread(target=lambda: running.append(
        post(frontend, **long).json()["choices"][0]["message"]["content"]))
    first.start()
    # Wait until it decodes, then fill the one queue slot with a second request.
    wait_for(frontend, lambda s: s["running"] >= 1)
    second = threading.Thread(target=lambda: post(frontend, max_tokens=50))
    second.start()
    wait_for(frontend, lambda s: s["queued"] >= 1)

    full = post(frontend, max_tokens=5)
    assert full.status_code == 429 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "queue_full"
    assert full.json()["error"]["type"] == "rate_limit_error"

    over_budget = post(frontend, max_tokens=30000)
    assert over_budget.status_code == 400
    assert over_budget.json()["error"]["code"] == "memory_budget_exceeded"
    assert over_budget.json()["error"]["param"] == "max_tokens"

    over_context = post(frontend, max_tokens=40000)
    assert over_context.status_code == 400
    assert over_context.json()["error"]["code"] == "context_length_exceeded"

    first.join(60)
    second.join(60)
    assert running == [reference], "the running request was disturbed"
    stats = httpx.get(f"{frontend.base_url}/stats").json()
    assert stats["rejections"] == {"queue_full": 1, "memory_budget_exceeded": 1, "context_length_exceeded": 1}
    assert stats["batching"] is True and stats["decode_concurrency"] == 1


# A valid 1x1 PNG.
PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"


def test_kv_bits_falls_back_to_serial_and_says_so(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    engine = Engine(f"ipc://{ipc_dir}/kvq.sock", tmp_path / "engined.log", model=str(tiny_model),
                    args=["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"])
    frontend = Frontend(engine.endpoint, tmp_path / "frontend.log", workers=1)
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        r = post(frontend, max_tokens=8)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        stats = httpx.get(f"{frontend.base_url}/stats").json()
        assert stats["batching"] is False and "kv-bits" in stats["batching_note"]
        assert "cannot batch a quantized KV cache" in engine.log()
        # An image is refused with a clear 400 here too (the serial path is text only).
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG_1PX}}
        r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30, json={
            "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    finally:
        frontend.stop()
        engine.stop()
