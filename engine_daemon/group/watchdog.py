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

# A gap this long between two of the watchdog's own 0.1 s ticks means the process was not running.
SUSPENDED_GAP = 1.0


class StepWatchdog(threading.Thread):
    def __init__(self, lockstep: Any, timeout: float, on_hang: Callable[[float], None], period: float = 0.1):
        super().__init__(name="group-watchdog", daemon=True)
        self.lockstep, self.timeout, self.on_hang, self.period = lockstep, timeout, on_hang, period
        self._halt = threading.Event()
        self.fired = False

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        last = time.monotonic()
        step, stood_still = None, 0.0
        while not self._halt.wait(self.period):
            now = time.monotonic()
            gap, last = now - last, now
            since = self.lockstep.in_step_since
            if since != step:
                step, stood_still = since, 0.0
            if gap > SUSPENDED_GAP:
                # This process stood still (SIGSTOP, a paused VM): not time its ranks took. Counted, a 6 s
                # pause of rank 0 failed a healthy group and blamed rank 1, which never stopped.
                stood_still += gap - self.period
            if since and now - since - stood_still > self.timeout:
                self.fired = True
                waited = now - since - stood_still
                log.critical("group step watchdog: tick %d has run %.1f s (--group-step-timeout %g): a rank hangs",
                             self.lockstep.tick, waited, self.timeout)
                self.on_hang(waited)
                return
