"""An engine group's settings: mode, this process's rank, the control endpoint, the fault limits.

`engined --group tp|pp` (MLX_ENGINE_GROUP) runs under `mlx.launch` or a service unit that sets
MLX_RANK and MLX_HOSTFILE (the ring backend's hostfile: a JSON list, one list of
"ip:port" per rank). The control endpoint (wake-ups and heartbeats, `control`) defaults to
rank 0's ring address with the port moved by CONTROL_PORT_OFFSET, so `mlx.launch` needs
nothing more.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

MODES = ("tp", "pp")
CONTROL_PORT_OFFSET = 100
# Exit status of a rank whose group failed (EX_TEMPFAIL): the launcher or the unit restarts the group.
GROUP_FAILED_EXIT = 75


@dataclass
class GroupSettings:
    mode: str  # "tp" (the model's shard()) | "pp" (its PipelineMixin pipeline)
    rank: int
    size: int
    backend: str
    control: str  # tcp://host:port of rank 0's control socket
    step_timeout: float = 60.0  # --group-step-timeout: rank 0's watchdog on one tick
    checksum_every: int = 16  # --group-checksum-every: ticks between token checksums (0: never)
    exit_delay: float = 3.0  # --group-exit-delay: a failed rank 0 answers /health this long, then exits

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, object]:
        return {"mode": self.mode, "size": self.size, "backend": self.backend, "rank": self.rank}


def default_control(hostfile: str | None) -> str | None:
    """tcp://<rank 0's ring ip>:<its ring port + offset>, from the ring hostfile (None: not a ring hostfile)."""
    if not hostfile:
        return None
    try:
        text = Path(hostfile).read_text() if Path(hostfile).is_file() else hostfile
        hosts = json.loads(text)
        first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
        host, port = str(first).rsplit(":", 1)
        return f"tcp://{host}:{int(port) + CONTROL_PORT_OFFSET}"
    except (OSError, ValueError, IndexError, TypeError, KeyError):
        return None


def from_environment(mode: str, control: str | None, rank: int, size: int, backend: str,
                     step_timeout: float, checksum_every: int, exit_delay: float) -> GroupSettings:
    """The settings of this rank; raises ValueError with an operator-facing message."""
    if mode not in MODES:
        raise ValueError(f"--group must be one of {', '.join(MODES)}, not {mode!r}")
    if size < 2:
        raise ValueError("--group needs at least 2 ranks: start engined with mlx.launch -n N (or set MLX_RANK "
                         "and MLX_HOSTFILE as deploy/groups.md shows); mx.distributed found a group of 1")
    control = control or default_control(os.environ.get("MLX_HOSTFILE"))
    if not control:
        raise ValueError("--group-control is needed when MLX_HOSTFILE is not a ring hostfile")
    if step_timeout <= 0:
        raise ValueError("--group-step-timeout must be a positive number of seconds")
    return GroupSettings(mode, rank, size, backend, control, step_timeout, max(0, checksum_every),
                         max(0.0, exit_delay))
