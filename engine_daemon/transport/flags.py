"""The io thread's command-line flags: how long a front-end may stay silent, how much it may leave unread."""

from __future__ import annotations

import argparse
import os

PEER_MAX_QUEUED_ENV = "MLX_ENGINE_PEER_MAX_QUEUED"
PEER_MAX_QUEUED_DEFAULT = "64MB"


def parse_size(value: str | None) -> int | None:
    """'2GB', '512MB', '1048576' -> bytes."""
    if not value:
        return None
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    text = value.strip().upper().replace("IB", "B")
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def add_transport_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer-timeout", type=float, default=float(os.environ.get("MLX_ENGINE_PEER_TIMEOUT", "10")),
                        help="seconds of silence after which a front-end's requests are aborted. "
                             "[MLX_ENGINE_PEER_TIMEOUT] (default: %(default)s)")
    parser.add_argument("--peer-max-queued", type=parse_size,
                        default=parse_size(os.environ.get(PEER_MAX_QUEUED_ENV) or PEER_MAX_QUEUED_DEFAULT),
                        help="output one front-end may leave unread (e.g. 64MB) before its requests are aborted: "
                             "a front-end that pings but stops reading made the engine queue GBs for it. A "
                             f"front-end's PINGs say how much it read (`rx`). [{PEER_MAX_QUEUED_ENV}] "
                             f"(default: {PEER_MAX_QUEUED_DEFAULT})")
    parser.add_argument("--stall-timeout", type=float,
                        default=float(os.environ.get("MLX_ENGINE_STALL_TIMEOUT", "60")),
                        help="seconds one step (or command) of the mlx thread may run before the engine reports "
                             "itself 'stalled' in pings and /health (model loads excepted). "
                             "[MLX_ENGINE_STALL_TIMEOUT] (default: %(default)s)")
