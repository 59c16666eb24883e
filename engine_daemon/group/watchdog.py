"""Rank 0's step watchdog: a hung peer blocks a collective forever, so a tick has a time limit.

A dead peer makes the ring backend raise within milliseconds; a hung one (SIGSTOP, a
wedged machine) does not, and rank 0's mlx thread would wait in its collective forever
with every stream open. This thread watches the tick in flight (`Lockstep.in_step_since`)
and calls `on_hang` once when it runs past --group-step-timeout.

What is known at that point, from the followers' heartbeats (`ControlServer`: sent by a
thread of their own, so they flow while a forward pass computes): a rank whose heartbeats
stopped hangs (SIGSTOP, a paused or wedged machine); a rank that never took this tick's
plan hangs before it; otherwise every rank is alive and inside the step. A decode step
then fails the group as before (a rank's step is wedged), but a step that prefills N
prompt tokens is slow, not hung: it may run to --group-step-timeout × (1 + N /
PREFILL_TOKENS_PER_TIMEOUT), at most 8 × (an 1,800-token chunk took over 60 s on a loaded 2-core box)
while every rank stays alive and inside it. `verdict` says which case fired and which rank.
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
# A step prefilling N tokens, every rank alive and inside it, may take timeout × (1 + N / this), at most
# MAX_PREFILL_FACTOR × the timeout: a rank wedged inside a long chunk (alive, never finishing) is still caught.
PREFILL_TOKENS_PER_TIMEOUT = 64
MAX_PREFILL_FACTOR = 8
STALE_AFTER = 1.5  # seconds without a follower's heartbeat (3 of them) that say it is not running


class StepWatchdog(threading.Thread):
    def __init__(self, lockstep: Any, timeout: float, on_hang: Callable[[float], None], period: float = 0.1,
                 control: Any = None):
        super().__init__(name="group-watchdog", daemon=True)
        self.lockstep, self.timeout, self.on_hang, self.period = lockstep, timeout, on_hang, period
        self.control = control  # ControlServer: the followers' heartbeats and progress (None: time alone)
        self._halt = threading.Event()
        self.fired = False
        self.verdict: tuple[str, int | None] = ("a rank hangs", None)  # what was known when it fired, which rank
        self.slow_steps = 0  # steps past the timeout that every rank was alive inside (a prefill): not failed

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        last = time.monotonic()
        step, stood_still, excused = None, 0.0, False
        while not self._halt.wait(self.period):
            now = time.monotonic()
            gap, last = now - last, now
            since = self.lockstep.in_step_since
            if since != step:
                step, stood_still, excused = since, 0.0, False
            if gap > SUSPENDED_GAP:
                # This process stood still (SIGSTOP, a paused VM): not time its ranks took. Counted, a 6 s
                # pause of rank 0 failed a healthy group and blamed rank 1, which never stopped.
                stood_still += gap - self.period
            waited = now - since - stood_still if since else 0.0
            if not since or waited <= self.timeout:
                continue
            tick = getattr(self.lockstep, "in_flight_tick", self.lockstep.tick)
            what, rank, allowed = self._judge(tick, getattr(self.lockstep, "in_flight_prefill", 0))
            if waited <= allowed:
                if not excused:
                    excused = True
                    self.slow_steps += 1
                    log.warning("group step watchdog: tick %d has run %.1f s (--group-step-timeout %g): %s; "
                                "waiting up to %.0f s", tick, waited, self.timeout, what, allowed)
                continue
            self.fired = True
            self.verdict = (what, rank)
            log.critical("group step watchdog: tick %d has run %.1f s (--group-step-timeout %g): %s", tick, waited,
                         self.timeout, what)
            self.on_hang(waited)
            return

    def _judge(self, tick: int, prefill: int) -> tuple[str, int | None, float]:
        """(what is known, the rank to blame or None, how long this step may run) once past the timeout."""
        control = self.control
        if control is None:
            return "a rank hangs", None, self.timeout
        now = time.monotonic()
        for rank in range(1, control.size):
            silent = now - control.last_seen.get(rank, 0.0)
            if silent > STALE_AFTER:
                return f"rank {rank} sent no heartbeat for {silent:.1f} s: it hangs", rank, self.timeout
        for rank in range(1, control.size):
            taken, inside = control.progress.get(rank, (-1, False))
            if taken < tick:
                return (f"rank {rank} never took tick {tick}'s plan (its last was tick {taken}): it hangs before "
                        "the step", rank, self.timeout)
        if prefill > 0:
            return (f"every rank is alive and inside this step, which prefills up to {prefill} tokens: slow, not "
                    "hung", None, self.timeout * min(1 + prefill / PREFILL_TOKENS_PER_TIMEOUT, MAX_PREFILL_FACTOR))
        return "every rank is alive and inside this decode step: a rank's step is wedged", None, self.timeout
