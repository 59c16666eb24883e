"""The group is the unit of failure: rank 0 ends every stream, says which rank failed, then exits 75.

Three ways in: a collective raised on the mlx thread (a dead peer: the ring backend says
"connection to a peer was lost" within milliseconds), the step watchdog fired (a hung
peer), or a follower's heartbeats stopped (a peer lost while the group was idle). The
first caller wins; the streams are failed by `fail_streams` (from whatever thread: the
mlx thread may be stuck in a collective), the failed rank is named from the heartbeats,
and after --group-exit-delay seconds (so /health can say which rank) the process exits
with GROUP_FAILED_EXIT for `mlx.launch` or the service units to restart the group.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from engine_daemon.group.control import HEARTBEAT, ControlServer
from engine_daemon.group.settings import GROUP_FAILED_EXIT

log = logging.getLogger(__name__)


class GroupFaults:
    def __init__(self, control: ControlServer, exit_delay: float, fail_streams: Callable[[str], None],
                 last_progress: Callable[[], float]):
        self.control = control
        self.exit_delay = exit_delay
        self.fail_streams = fail_streams
        self.last_progress = last_progress  # monotonic end of the last tick all ranks finished
        self._lock = threading.Lock()
        self.failure: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def fail(self, reason: str, rank: int | None = None, streams_failed: bool = False) -> None:
        """Records the first failure, fails the streams (unless the caller did) and schedules the exit."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = {"reason": reason, "failed_rank": rank, "at": time.time()}
            progress = self.last_progress()
        log.critical("engine group failed: %s", reason)
        if not streams_failed:
            try:
                self.fail_streams(reason)
            except Exception:
                log.exception("could not fail the open streams")
        # Engine-measured: from the last step every rank finished to every open stream's error event.
        self.failure["streams_failed_after_s"] = round(time.monotonic() - progress, 3) if progress else None
        threading.Thread(target=self._name_rank_then_exit, name="group-exit", daemon=True).start()

    def _name_rank_then_exit(self) -> None:
        started = time.monotonic()
        # The lost rank's heartbeats stop; a live one's keep coming (every HEARTBEAT s).
        while self.failure["failed_rank"] is None and time.monotonic() - started < HEARTBEAT * 5:
            stale = self.control.stale_ranks(older_than=HEARTBEAT * 3)
            if stale:
                self.failure["failed_rank"] = stale[0]
                break
            time.sleep(0.05)
        log.critical("engine group failed at rank %s; exiting with %d in %.1f s", self.failure["failed_rank"],
                     GROUP_FAILED_EXIT, self.exit_delay)
        time.sleep(max(0.0, self.exit_delay - (time.monotonic() - started)))
        self.control.flush_refusal()  # with --group-exit-delay 0 the followers must still hear why
        logging.shutdown()
        os._exit(GROUP_FAILED_EXIT)
