"""A lone prompt beside a stream is planned under the gap target when its TTFT target leaves room (`--max-ttft-ratio`).

`--max-ttft-ratio 1000` leaves the newcomer all the room there is, so once its first paced step
has taught the pacer its rate, the plan is the pacer's least target, `ratio / (1 + ratio)` decode
steps (2/3 at the default 3x gap target), where the gap plan alone never goes under one decode
step (`MOST_SPREAD` caps its room).
It needs a lone full-speed prefill on record first (`AloneCosts`): the TTFT target's reference.
Read from the engine's own step trace.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Frontend, running_stack, stream_running

PACED = re.compile(r"step [\d.]+ ms: (\d+) decoding, (\d+) prompt tokens \(chunk \d+(?:, fused)?; "
                   r"prefill target \d+ ms, ([\d.]+) decode steps(, balanced)?\)")


@pytest.fixture(scope="module")
def stack(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Frontend, Path]]:
    logs = tmp_path_factory.mktemp("balance-logs")
    with running_stack(f"ipc://{ipc_dir}/balance.sock", logs, model=str(tiny_model),
                       engine_args=["--max-ttft-ratio", "1000", "--no-layer-cuts"],
                       env={"MLX_ENGINE_LOG_LEVEL": "DEBUG"}) as (_, frontend):
        yield frontend, logs / "engined.log"


def _planned_beside_streams(log_path: Path, offset: int) -> list[tuple[float, bool]]:
    """(plan in decode steps, whether balanced) logged after each step past `offset` that prefilled beside a stream."""
    return [(float(ratio), bool(balanced)) for decoding, tokens, ratio, balanced
            in PACED.findall(log_path.read_text()[offset:]) if int(decoding) >= 1 and int(tokens) > 1]


def test_a_newcomer_with_room_under_its_ttft_target_is_planned_under_the_gap_target(
        stack: tuple[Frontend, Path], model_id: str) -> None:
    frontend, log_path = stack
    url = f"{frontend.base_url}/v1/chat/completions"
    alone = httpx.post(url, timeout=120, json={
        "model": model_id, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": " ".join(f"alone{j % 193}" for j in range(400))}]})
    assert alone.status_code == 200 and alone.json()["usage"]["prompt_tokens"] >= 512

    with stream_running(url, model_id, max_tokens=6000):
        offset = len(log_path.read_text())
        fresh = httpx.post(url, timeout=120, json={
            "model": model_id, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(f"fresh{j % 181}" for j in range(400))}]})
        assert fresh.status_code == 200
        plans = _planned_beside_streams(log_path, offset)
    assert len(plans) >= 3, f"the newcomer was not paced: {plans}"
    assert all(abs(plan - 2 / 3) < 0.011 and balanced for plan, balanced in plans), plans
