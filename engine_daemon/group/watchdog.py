"""Rank 0's step watchdog: a hung peer blocks a collective forever, so a tick has a time limit.

A dead peer makes the ring backend raise within milliseconds; a hung one (SIGSTOP, a
wedged machine) does not, and rank 0's mlx thread would wait in its collective forever
with every stream open. This thread watches the tick in flight (`Lockstep.in_step_since`)
and calls `on_hang` once when it runs past --group-step-timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class StepWatchdog(threading.Thread):
    def __init__(self, lockstep: Any, timeout: float, on_hang: Callable[[float], None], period: float = 0.1):
        super().__init__(name="group-watchdog", daemon=True)
        self.lockstep, self.timeout, self.on_hang, self.period = lockstep, timeout, on_hang, period
        self._halt = threading.Event()
        self.fired = False

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            since = self.lockstep.in_step_since
            if since and time.monotonic() - since > self.timeout:
                self.fired = True
                waited = time.monotonic() - since
                log.critical("group step watchdog: tick %d has run %.1f s (--group-step-timeout %g): a rank hangs",
                             self.lockstep.tick, waited, self.timeout)
                self.on_hang(waited)
                return
