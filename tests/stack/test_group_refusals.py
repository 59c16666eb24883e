"""Engine groups refused at start: rank 0 tells every follower why over the control socket, and the follower
logs it and exits at once (it used to wait, silent, until rank 0 was gone); a follower on an older engine
(heartbeats without a weights digest field) is refused at once, naming the rank, instead of after 120 s.

Two real ranks over loopback, started as service units do (MLX_RANK + MLX_HOSTFILE), on the tiny-group
random-weight model. Rank 0's --group-exit-delay is long, so a follower that exits while rank 0 still
answers /health exited on rank 0's word, not because rank 0 went silent.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend
from tests.stack.test_groups import _group_port, _stop_group

EXIT_DELAY = 30.0  # rank 0 answers /health this long after the refusal, then exits 75
FOLLOWER_OLDER_ENGINE = {"MLX_ENGINE_FAULT_INJECTION": "1", "MLX_ENGINE_DEBUG_GROUP_HEARTBEAT_FIELDS": "4"}


@pytest.fixture(scope="module")
def group_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_builders.text import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-group", size="tiny-group", seed=0)


def _start(models: tuple[Path, Path], endpoint: str, tmp_path: Path,
           follower_env: dict[str, str] | None = None) -> tuple[list[Engine], Frontend]:
    port = _group_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    envs = [{}, follower_env or {}]
    ranks = [Engine(endpoint, tmp_path / f"rank{rank}.log", model=str(model),
                    args=["--group", "tp", "--group-exit-delay", str(EXIT_DELAY)],
                    env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), **envs[rank]})
             for rank, model in enumerate(models)]
    return ranks, Frontend(endpoint, tmp_path / "frontend.log", workers=1)


def _wait_refused(frontend: Frontend, ranks: list[Engine], timeout: float) -> dict:
    """/health's body once it says group_failed; never 200 on the way (the group must not serve)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            health = httpx.get(f"{frontend.base_url}/health", timeout=5)
        except httpx.HTTPError:
            health = None
        assert health is None or health.status_code != 200, health.text
        if health is not None and health.json().get("status") == "group_failed":
            assert health.status_code == 503
            return health.json()
        assert ranks[0].popen.poll() is None, ranks[0].log()[-3000:]
        assert time.monotonic() < deadline, [rank.log()[-3000:] for rank in ranks]
        time.sleep(0.1)


def _wait_exit(rank: Engine, timeout: float) -> int:
    try:
        return rank.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"rank still running after {timeout} s:\n{rank.log()[-3000:]}") from None


def test_a_follower_on_other_weights_is_told_why_and_exits(group_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """Rank 1 loads other weights: rank 0 refuses the group and sends rank 1 the reason; rank 1 logs it at ERROR
    and exits 75 while rank 0 still answers /health (on rank 0's word, not after rank 0 went silent)."""
    from model_builders.text import build_model

    other = build_model(tmp_path / "tiny-group-other", size="tiny-group", seed=1)
    ranks, frontend = _start((group_model, other), f"ipc://{ipc_dir}/grp-refused.sock", tmp_path)
    try:
        health = _wait_refused(frontend, ranks, 90)
        assert health["group"]["failed_rank"] == 1, health["group"]
        assert _wait_exit(ranks[1], EXIT_DELAY - 5) == 75
        assert ranks[0].popen.poll() is None, ranks[0].log()[-3000:]  # rank 0 still in its exit delay
        follower = ranks[1].log()
        refused = [line for line in follower.splitlines() if "rank 0 refused the group" in line]
        assert refused and " ERROR " in refused[0], follower[-3000:]
        assert "loaded other weights than rank 0" in refused[0] and "exits 75" in refused[0], refused
        assert "rank 0 silent" not in follower
        assert "told the followers" in ranks[0].log()
    finally:
        _stop_group(frontend, ranks)


def test_a_follower_on_an_older_engine_is_refused_at_once(group_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """Rank 1's heartbeats carry no digest field (MLX_ENGINE_DEBUG_GROUP_HEARTBEAT_FIELDS=4: the format before
    the weights check): rank 0 refuses the group naming rank 1 and the version difference, without waiting
    out its 120 s, and /health says so; this follower understands the refusal and exits (a really old one
    would exit when rank 0 goes silent)."""
    ranks, frontend = _start((group_model, group_model), f"ipc://{ipc_dir}/grp-older.sock", tmp_path,
                             follower_env=FOLLOWER_OLDER_ENGINE)
    try:
        health = _wait_refused(frontend, ranks, 60)  # well under rank 0's 120 s wait for a digest
        group = health["group"]
        assert group["failed_rank"] == 1 and "rank 1 runs an older mlx-engined" in group["reason"], group
        assert "versions differ" in group["reason"] and group["ranks"][1].get("older_engine") is True, group
        leader = ranks[0].log()
        assert "rank 1's heartbeats have 4 fields" in leader and "rank 1 runs an older mlx-engined" in leader
        assert "engine group ready" not in leader
        assert _wait_exit(ranks[1], EXIT_DELAY - 5) == 75
        assert "rank 1 runs an older mlx-engined" in ranks[1].log()
    finally:
        _stop_group(frontend, ranks)
