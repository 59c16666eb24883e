"""Rank 0's half of lockstep: record what the scheduler does to its generator, broadcast it as a plan.

The batch scheduler tells `Lockstep` about every insert and removal it makes and calls
`before_step` just before `generator.next()`: the recorded ops, the prefill chunk size its
pacer chose and the step itself go out as one `StepPlan` (`PlanChannel.exchange`) on the
generation stream, so every follower applies them before the same forward pass.
After the step, every `checksum_every` ticks the ranks compare token checksums.

Seeds: a sampled request without a seed gets one drawn here and carried in the plan, so
every rank samples from the same key chain (unsynced draws diverged silently).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable
from typing import Any

from engine_daemon.errors import RequestError
from engine_daemon.group.checksum import TokenChecksum, mismatched_ranks
from engine_daemon.group.control import ControlServer
from engine_daemon.group.plan import AddOp, StepPlan
from engine_daemon.group.wire import PlanChannel

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """The group cannot go on (a rank died, hung or diverged): every rank stops and restarts."""


def agree_seed(sampling: dict[str, Any]) -> dict[str, Any]:
    """A sampled request's settings with a seed every rank will use (the client's, else a fresh one)."""
    if float(sampling.get("temperature", 0.0) or 0.0) > 0 and sampling.get("seed") is None:
        sampling = {**sampling, "seed": secrets.randbits(63)}
    return sampling


class Lockstep:
    def __init__(self, channel: PlanChannel, control: ControlServer, checksum_every: int):
        self.channel = channel
        self.control = control
        self.checksum_every = checksum_every
        self.checksum = TokenChecksum()
        self.tick = 0
        self._ops: list[tuple[str, Any]] = []
        self._plan: StepPlan | None = None
        self.sleeping = True  # followers wait for a wake (`ControlServer.wake`) before the next plan
        self.last_progress = time.monotonic()  # end of the last tick every rank finished
        self.in_step_since = 0.0  # monotonic start of the tick in flight (the watchdog's clock); 0: none
        # The tick in flight and the prompt tokens its step may prefill at most (0: a decode step or no step):
        # the watchdog gives a step that prefills more time (`StepWatchdog`).
        self.in_flight_tick = -1
        self.in_flight_prefill = 0
        self._prefilling: dict[int, int] = {}  # uid -> prompt tokens to prefill, until its first token
        self.plan_seconds = 0.0  # time spent broadcasting plans, waits for the slowest rank included
        self.plans = 0
        self.checksums = 0

    # -- what the scheduler did ---------------------------------------------------------------
    def added(self, uid: int, prompt: list[int], max_tokens: int, sampling: dict[str, Any], eos: list[int],
              cached: int = 0, entry: int = -1, entry_len: int = 0, processors: dict[str, Any] | None = None) -> None:
        self._ops.append(("add", AddOp(uid, [int(t) for t in prompt], int(max_tokens), dict(sampling),
                                       [int(t) for t in eos], int(cached), int(entry), int(entry_len), processors)))
        self._prefilling[int(uid)] = len(prompt)

    def stored(self, uid: int, entry: int) -> None:
        """Rank 0 kept uid's KV as prompt-cache entry `entry` (`PlannedPrefixCache`): so does every rank."""
        self._ops.append(("store", [int(uid), int(entry)]))

    def evicted(self, entries: list[int]) -> None:
        self._ops.append(("evict", [int(entry) for entry in entries]))

    def removed(self, uids: Iterable[int]) -> None:
        uids = [int(uid) for uid in uids]
        for uid in uids:
            self._prefilling.pop(uid, None)
        if uids:
            self._ops.append(("remove", uids))

    # -- ticks -----------------------------------------------------------------------------------
    def before_step(self, prefill_step_size: int) -> None:
        every = self.checksum_every
        plan = StepPlan(self.tick, self._ops, int(prefill_step_size), step=True,
                        checksum=bool(every) and (self.tick + 1) % every == 0)
        self._send(plan)

    def after_step(self, uid_tokens: Iterable[tuple[int, int]]) -> None:
        """Folds the step's tokens into the checksum and compares it when the plan said so."""
        uid_tokens = list(uid_tokens)
        for uid, _ in uid_tokens:  # its first token: its prefill is done
            self._prefilling.pop(uid, None)
        self.checksum.observe(uid_tokens)
        if self._plan is not None and self._plan.checksum:
            values = self.channel.agree(self.checksum.value)
            self.checksums += 1
            bad = mismatched_ranks(values)
            if bad:
                raise GroupFailed(f"token checksum mismatch at tick {self._plan.tick}: ranks {bad} generated other "
                                  f"tokens than rank 0 ({values})")
        self.in_step_since = 0.0
        self.last_progress = time.monotonic()

    def go_idle(self) -> None:
        """Nothing left to run: the followers apply what is pending and go back to their idle wait."""
        if self.sleeping:
            return
        self._send(StepPlan(self.tick, self._ops, idle=True))
        self.sleeping = True
        self.in_step_since = 0.0
        self.last_progress = time.monotonic()

    def stop(self) -> None:
        """A clean shutdown: followers leave their loop and exit 0."""
        self._send(StepPlan(self.tick, self._ops, stop=True))
        self.in_step_since = 0.0

    def _send(self, plan: StepPlan) -> None:
        self.in_flight_tick = plan.tick
        # At most one chunk of each prompt still prefilling (an upper bound: the generator may take less).
        self.in_flight_prefill = sum(min(left, plan.prefill_step_size) for left in self._prefilling.values()) \
            if plan.step else 0
        self.in_step_since = time.monotonic()
        if self.sleeping:
            self.control.wake()
            self.sleeping = False
        started = time.perf_counter()
        self.channel.exchange(plan.encode())
        self.plan_seconds += time.perf_counter() - started
        self.plans += 1
        self._plan = plan
        self._ops = []
        self.tick += 1

    def stats(self) -> dict[str, Any]:
        return {"ticks": self.tick, "plans": self.plans, "plan_bytes": self.channel.bytes_sent,
                "plan_us_mean": round(self.plan_seconds / self.plans * 1e6, 1) if self.plans else None,
                "checksums": self.checksums, "checksum_tokens": self.checksum.tokens,
                "wakes": self.control.wakes}


def check_replayable(request: Any) -> None:
    """What followers cannot replay from a plan is refused in a group, never half-served."""
    if request.body.get("adapter"):
        raise RequestError(400, "unsupported_in_group", "LoRA adapters are not served by an engine group",
                           param="model")
    if request.processors and request.processor_spec is None:  # processors followers could not rebuild
        raise RequestError(400, "unsupported_in_group", "This request's logits processors cannot be replayed "
                           "by an engine group", param="response_format")
