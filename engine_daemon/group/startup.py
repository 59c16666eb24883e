"""Rank 0's checks before a group serves: every rank loaded the same weights.

Why: each rank loads the model from its own disk. A follower started on another
directory, or on the same architecture with other weights, shards, runs and heartbeats
like a sound one; only the first token checksum (after the group was reported healthy,
and after it served wrong text) would notice. Each rank hashes a sample of the whole
checkpoint's files (`engine_daemon.models.digest.weights_digest`, milliseconds) and reports
it in its heartbeats; rank 0 compares them with its own before the group goes ready.

A follower whose heartbeats carry no digest field at all runs an engine from before this check:
it would never report one, so rank 0 refuses at once, naming the rank, instead of waiting out the
timeout (a follower still loading sends "-" in that field and is waited for). Rank 0 refuses on
that rank's first heartbeat (`GroupLeader`), before or during its own load, in case the two
versions' loads do not even meet.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine_daemon.group.control import ControlServer

log = logging.getLogger(__name__)


def check_weights(loaded: Any, control: ControlServer, timeout: float) -> tuple[str | None, int | None]:
    """(None, None) when every follower reported rank 0's weights digest; else (why, the first rank that differs)."""
    own = getattr(loaded, "weights_digest", "") if loaded is not None else ""
    followers = range(1, control.size)
    deadline = time.monotonic() + timeout
    # A follower finished its load with rank 0 (the load ends in a collective); its next heartbeat carries the digest.
    while any("weights_digest" not in control.reports.get(rank, {}) for rank in followers):
        older = [rank for rank in followers if rank in control.older]
        if older:
            return older_engine(older[0], control.older[older[0]]), older[0]
        if time.monotonic() > deadline:
            silent = [rank for rank in followers if "weights_digest" not in control.reports.get(rank, {})]
            return f"ranks {silent} reported no weights digest in {timeout:.0f} s", silent[0]
        time.sleep(0.05)
    digests = {rank: control.reports[rank]["weights_digest"] for rank in followers}
    differ = [rank for rank, digest in digests.items() if digest != own]
    if not differ:
        log.info("group: every rank loaded the same weights (digest %s)", own)
        return None, None
    where = getattr(getattr(loaded, "ref", None), "path", "?")
    theirs = ", ".join(f"{digests[rank]} on rank {rank}" for rank in differ)
    return (f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} loaded other weights than rank 0 "
            f"(weights digest {own} on rank 0 from {where}; {theirs}): start every rank on the same model files"), \
        differ[0]


def older_engine(rank: int, fields: int) -> str:
    """Why rank 0 refuses a follower whose heartbeats have no digest field (`ControlServer.older`)."""
    return (f"rank {rank} runs an older mlx-engined than rank 0 (heartbeats of {fields} fields, with no weights "
            f"digest): the engines' versions differ; start every rank on the same mlx-engined version")
