"""A burst of prompts beside a running stream is prefilled at full speed in bounded steps (--max-stall-seconds).

Read from the engine's own step trace (`MLX_ENGINE_LOG_LEVEL=DEBUG`), not from client clocks:
every step that prefilled the burst also decoded the running stream, and no such step took
more than the floor chunk per prompt. Without the bound, the three prompts went in one step
of ~4,000 tokens (this test fails with `--max-stall-seconds 0`).

The burst must reach the engine as one: the mlx thread is held (`debug_sleep`, fault injection) while
the three prompts arrive. On a loaded CI machine they once landed a few steps apart, the first alone
beside the stream (paced, not a burst) and the test read that as unbounded.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine_daemon.scheduling.prefill_pacer import FULL_SPEED_MINIMUM
from tests.helpers import Engine, Frontend, call_engine, running_stack

STEP = re.compile(r"step [\d.]+ ms: (\d+) decoding, (\d+) prompt tokens \(chunk (\d+)")
PROMPT_WORDS = 700  # over 1,000 prompt tokens each: one step for all three without the bound


@pytest.fixture(scope="module")
def stack(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Engine, Frontend, Path]]:
    logs = tmp_path_factory.mktemp("burst-logs")
    with running_stack(f"ipc://{ipc_dir}/burst.sock", logs, model=str(tiny_model),
                       engine_args=["--max-stall-seconds", "0.000001"],
                       env={"MLX_ENGINE_LOG_LEVEL": "DEBUG", "MLX_ENGINE_FAULT_INJECTION": "1"}) as (engine, frontend):
        yield engine, frontend, logs / "engined.log"


def _hold_the_mlx_thread(engine: Engine, log_path: Path, seconds: float) -> threading.Thread:
    """Starts a `debug_sleep` of the mlx thread and returns once the engine logs it sleeping."""
    hold = threading.Thread(target=call_engine, args=(engine.endpoint, "debug_sleep", {"seconds": seconds}),
                            kwargs={"timeout": seconds + 60})
    hold.start()
    deadline = time.monotonic() + 60
    while "mlx thread sleeps" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return hold


def _body(model: str, text: str, max_tokens: int, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def test_a_burst_beside_a_stream_is_prefilled_in_bounded_steps(stack: tuple[Engine, Frontend, Path],
                                                               model_id: str) -> None:
    engine, frontend, log_path = stack
    url = f"{frontend.base_url}/v1/chat/completions"
    streaming = threading.Event()
    stream_status: list[int] = []

    def stream() -> None:
        body = _body(model_id, "Tell a long story.", 600, stream=True, ignore_eos=True)
        with httpx.stream("POST", url, json=body, timeout=300) as response:
            stream_status.append(response.status_code)
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    streaming.set()

    runner = threading.Thread(target=stream)
    runner.start()
    assert streaming.wait(120), "the running stream never produced a token"
    prompts = [" ".join(f"word{(i * 7 + j) % 503}" for j in range(PROMPT_WORDS)) for i in range(3)]
    hold = _hold_the_mlx_thread(engine, log_path, 4.0)  # the three land while it sleeps
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda text: httpx.post(url, json=_body(model_id, text, 4), timeout=300), prompts))
    runner.join(300)
    hold.join(120)
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text[:200] for r in replies]
    assert stream_status == [200]

    steps = [tuple(map(int, m.groups())) for m in STEP.finditer(log_path.read_text())]
    # Steps at full speed beside the stream: more prompts waited than streamed (chunk at the floor).
    burst = [(decoding, tokens) for decoding, tokens, chunk in steps
             if decoding >= 1 and tokens > 0 and chunk == FULL_SPEED_MINIMUM]
    assert len(burst) >= 3, f"the burst was not split into bounded steps: {[s for s in steps if s[1]][:20]}"
    # Each of those steps also decoded the stream and took at most the floor chunk per waiting prompt.
    assert all(tokens <= 3 * FULL_SPEED_MINIMUM for _, tokens in burst), burst
