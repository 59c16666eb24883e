"""Requests sent together to an idle engine are prefilled together (`--coalesce-ms`).

The front-end renders and tokenizes each request in turn, so requests fired at once reach
the engine a few ms apart: without the wait the first was prefilled alone and the others
queued behind that step. Here the first request leads the others by ~100 ms on purpose and
the window is long, so the outcome does not hang on how fast a CI machine is; what is
asserted comes from the engine's own counters and step trace, not from client clocks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend

STEP = re.compile(r"step [\d.]+ ms: (\d+) decoding, (\d+) prompt tokens")
REQUESTS = 4
PROMPT_WORDS = 120  # ~250 tokens each: long enough to be worth a wait before any prefill speed is measured


def _stack(tiny_model: Path, ipc_dir: Path, logs: Path, name: str, coalesce_ms: str) -> Iterator[tuple[Frontend, Path]]:
    log_path = logs / f"{name}-engined.log"
    engine = Engine(f"ipc://{ipc_dir}/{name}.sock", log_path, model=str(tiny_model),
                    args=["--coalesce-ms", coalesce_ms], env={"MLX_ENGINE_LOG_LEVEL": "DEBUG"})
    frontend = Frontend(engine.endpoint, logs / f"{name}-frontend.log", workers=2)
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        yield frontend, log_path
    finally:
        frontend.stop()
        engine.stop()


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("coalesce-logs")


@pytest.fixture(scope="module")
def coalescing(tiny_model: Path, ipc_dir: Path, logs: Path) -> Iterator[tuple[Frontend, Path]]:
    yield from _stack(tiny_model, ipc_dir, logs, "coalesce", "2000")


@pytest.fixture(scope="module")
def not_coalescing(tiny_model: Path, ipc_dir: Path, logs: Path) -> Iterator[tuple[Frontend, Path]]:
    yield from _stack(tiny_model, ipc_dir, logs, "no-coalesce", "0")


def _chat(frontend: Frontend, model_id: str, text: str) -> httpx.Response:
    body = {"model": model_id, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{frontend.base_url}/v1/chat/completions", json=body, timeout=120)


def _staggered_burst(frontend: Frontend, model_id: str, lead: Callable[[], None]) -> list[int]:
    """One request, then three more once `lead` returns; their status codes."""
    prompts = [" ".join(f"word{(i * 11 + j) % 397}" for j in range(PROMPT_WORDS)) for i in range(REQUESTS)]
    with ThreadPoolExecutor(REQUESTS) as pool:
        first = pool.submit(_chat, frontend, model_id, prompts[0])
        lead()
        rest = [pool.submit(_chat, frontend, model_id, text) for text in prompts[1:]]
        return [future.result().status_code for future in [first, *rest]]


def _until_accepted(log_path: Path, offset: int) -> Callable[[], None]:
    """Waits until the engine logs that it accepted a request after `offset`: a lead taken from the engine's clock.

    A cold front-end worker can take longer than any fixed client-side sleep to render its first request, so the
    control must not assume the first request reaches the engine first.
    """
    def wait() -> None:
        deadline = time.monotonic() + 60
        while " accepted " not in log_path.read_text()[offset:]:
            assert time.monotonic() < deadline, "the engine never accepted the first request"
            time.sleep(0.005)
    return wait


def _first_prefill_tokens(log_path: Path, offset: int) -> int:
    """Prompt tokens of the engine's first step after `offset` in its log that prefilled more than a last token."""
    return next((int(tokens) for _, tokens in STEP.findall(log_path.read_text()[offset:]) if int(tokens) > 1), 0)


def _engine_stats(frontend: Frontend) -> dict:
    stats = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
    return stats.get("engine", stats)


def test_a_short_prompt_does_not_wait(coalescing: tuple[Frontend, Path], model_id: str) -> None:
    frontend, _ = coalescing
    assert _chat(frontend, model_id, "hi").status_code == 200
    stats = _engine_stats(frontend)
    assert stats["coalesce_waits"] == 0 and stats["coalesced_requests"] == 0, stats


def test_requests_close_behind_the_first_join_its_prefill(coalescing: tuple[Frontend, Path], model_id: str) -> None:
    frontend, log_path = coalescing
    offset = len(log_path.read_text())
    assert _staggered_burst(frontend, model_id, lambda: time.sleep(0.1)) == [200] * REQUESTS
    stats = _engine_stats(frontend)
    assert stats["coalesce_waits"] == 1 and stats["coalesced_requests"] == REQUESTS - 1, stats
    first = _first_prefill_tokens(log_path, offset)
    assert first >= REQUESTS * 200, f"the first prefill step took {first} tokens, not all {REQUESTS} prompts"


def test_with_no_window_the_first_is_prefilled_alone(not_coalescing: tuple[Frontend, Path], model_id: str) -> None:
    """The control: the same burst with `--coalesce-ms 0` starts with the first prompt alone."""
    frontend, log_path = not_coalescing
    offset = len(log_path.read_text())
    assert _staggered_burst(frontend, model_id, _until_accepted(log_path, offset)) == [200] * REQUESTS
    stats = _engine_stats(frontend)
    assert stats["coalesce_waits"] == 0 and stats["coalesced_requests"] == 0, stats
    assert 0 < _first_prefill_tokens(log_path, offset) < 2 * 200
