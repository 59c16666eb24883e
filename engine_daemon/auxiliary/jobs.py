"""Auxiliary work in bounded slices, run by the mlx thread between two scheduler steps.

An embedding batch or a Whisper decode cannot yield midway by itself; run whole, a 50-input
request or a 30-second window would freeze every chat stream for its duration. So each piece of
auxiliary work is an `AuxiliaryJob` whose `step(budget)` does a bounded slice (about
`budget` tokens of work) and says whether it is finished, and the worker runs one slice
per loop turn (`AuxiliaryQueue.tick`), after the scheduler's step. Client-controlled CPU
work (tokenizing, audio decoding) is the job's `prepare`, run on the admission pool,
never on the mlx thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from engine_daemon.errors import RequestError, describe
from protocol import MsgType

log = logging.getLogger(__name__)

# (peer identity, message type, body), as the schedulers' events
Event = tuple[bytes, MsgType, dict[str, Any]]


class AuxiliaryJob:
    """One request's auxiliary work. Subclasses implement `step` and `result`.

    `prepare` runs first, once, on the admission pool (no MLX there: CPU work on what the
    client sent, bounded, raising RequestError for bad input). `step` runs on the mlx thread.
    `finished` may turn true without a `step` of this job: embedding jobs share batches, so
    another job's step can compute this one's vectors (cross-request batching).
    """

    kind: str = ""
    held_bytes: int = 0  # what the job keeps from its request (an upload's samples): `--max-queued-audio-seconds`
    # Tokens of work the last `step` did (the queue learns the cost of a token from it); None: the budget.
    last_slice_tokens: int | None = None

    def prepare(self) -> None:
        """Off-thread preparation (tokenizing, decoding); the default has none."""

    def queued(self) -> None:
        """Called on the mlx thread when the job joins the queue (after `prepare`); the default does nothing."""

    def step(self, budget: int) -> bool:
        """A bounded slice of MLX work (about `budget` tokens); True once the job is finished."""
        raise NotImplementedError

    def finished(self) -> bool:
        return False

    def close(self) -> None:
        """The job leaves the queue unfinished (cancelled, failed, unloaded); the default has nothing to end."""

    def partials(self) -> list[Any]:
        """RESULT values to send before the final one (long CALLs: a transcript window, a piece of
        speech), taken after each slice; the default has none."""
        return []

    def result(self) -> Any:
        """The CALL's RESULT body (plain msgpack values; arrays as raw little-endian float32 bytes)."""
        raise NotImplementedError


@dataclass(frozen=True)
class AuxiliaryRequest:
    """A validated auxiliary CALL: which kind of model, the name asked for, the job's arguments."""

    kind: str
    model: str | None
    args: dict[str, Any]


@dataclass
class _Entry:
    peer: bytes
    cid: str
    job: AuxiliaryJob


# Sizing the slice (`--aux-step-tokens 0`): while requests decode, a slice may add this share of one
# decode step to their inter-token gap (so a stream's gaps stay under 2x its steady ones); when
# nothing decodes, there is nobody to slow down and slices are the largest.
GAP_SHARE = 0.8
IDLE_BUDGET = 4096
MIN_BUDGET = 16
FIRST_BUDGET = 64


@dataclass
class AuxiliaryQueue:
    """Jobs in arrival order; the head job gets one slice per tick; finished jobs are answered.

    The slice's token budget is `fixed` (--aux-step-tokens N) or sized each tick from what the
    queue has measured: seconds per token of auxiliary work (smoothed over recent slices) and the
    seconds of a decode step (the scheduler's measure), so one slice costs about `GAP_SHARE`
    decode steps while streams run.
    """

    fixed: int = 0  # --aux-step-tokens; 0: sized from measurements
    entries: deque[_Entry] = field(default_factory=deque)
    counts: Counter = field(default_factory=Counter)
    seconds_per_token: float | None = None  # the last measured kind's (reported in /stats)
    rates: dict[str, float] = field(default_factory=dict)  # seconds per token, per job kind
    budget: int = FIRST_BUDGET  # the last slice's budget (reported in /stats)

    def add(self, peer: bytes, cid: str, job: AuxiliaryJob) -> None:
        job.queued()
        self.entries.append(_Entry(peer, cid, job))
        self.counts[f"{job.kind}_jobs"] += 1

    def has_work(self) -> bool:
        return bool(self.entries)

    def held_bytes(self) -> int:
        return sum(entry.job.held_bytes for entry in self.entries)

    def slice_budget(self, decode_seconds: float | None, kind: str = "") -> int:
        """Tokens for the next slice of a `kind` job; `decode_seconds`: a decode step's cost, None when
        nothing decodes. A token's cost is measured per kind: an embedding token and a Whisper decoder
        token differ by orders of magnitude."""
        if self.fixed:
            return self.fixed
        if decode_seconds is None:
            return IDLE_BUDGET
        rate = self.rates.get(kind)
        if rate is None:
            return FIRST_BUDGET if kind != "transcription" else MIN_BUDGET
        return int(min(IDLE_BUDGET, max(MIN_BUDGET if kind != "transcription" else 1,
                                        GAP_SHARE * decode_seconds / rate)))

    def _observe(self, seconds: float, tokens: int, kind: str = "") -> None:
        if tokens <= 0:
            return
        sample = seconds / tokens
        previous = self.rates.get(kind)
        self.rates[kind] = self.seconds_per_token = sample if previous is None else 0.7 * previous + 0.3 * sample

    def tick(self, decode_seconds: float | None = None) -> list[Event]:
        """One slice of the head job, then an answer for every job that is finished by now."""
        if not self.entries:
            return []
        head = self.entries[0]
        events: list[Event] = []
        self.budget = self.slice_budget(decode_seconds, head.job.kind)
        try:
            head.job.last_slice_tokens = None
            started = time.perf_counter()
            head.job.step(self.budget)
            used = head.job.last_slice_tokens
            self._observe(time.perf_counter() - started, self.budget if used is None else used, head.job.kind)
            self.counts["slices"] += 1
            events += [(head.peer, MsgType.RESULT, {"cid": head.cid, "result": value, "partial": True})
                       for value in head.job.partials()]
        except RequestError as exc:
            events.append(self._error(head, exc))
        except Exception as exc:  # a bug in one job fails that job, never the mlx thread
            log.exception("auxiliary %s job failed", head.job.kind)
            events.append(self._error(head, RequestError(500, "engine_error", describe(exc),
                                                         error_type="server_error")))
        failed = any(kind == MsgType.ERROR for _, kind, _ in events)
        for entry in list(self.entries):
            if entry is head and failed:
                continue
            if entry.job.finished():
                self.entries.remove(entry)
                self.counts[f"{entry.job.kind}_done"] += 1
                events.append((entry.peer, MsgType.RESULT, {"cid": entry.cid, "result": entry.job.result()}))
        return events

    def _error(self, entry: _Entry, error: RequestError) -> Event:
        self.entries.remove(entry)
        entry.job.close()
        self.counts[f"{entry.job.kind}_failed"] += 1
        return (entry.peer, MsgType.ERROR, {**error.to_body(None), "cid": entry.cid})

    def cancel(self, peer: bytes, cids: set[str] | None) -> int:
        """Drops `peer`'s jobs with these CALL ids (None: all of them), unanswered: their client left."""
        gone = [e for e in self.entries if e.peer == peer and (cids is None or e.cid in cids)]
        for entry in gone:
            self.entries.remove(entry)
            entry.job.close()
            self.counts[f"{entry.job.kind}_cancelled"] += 1
        return len(gone)

    def fail(self, kind: str | None, error: RequestError) -> list[Event]:
        """Ends the jobs of `kind` (None: all) with `error`: their model was unloaded."""
        return [self._error(entry, error) for entry in list(self.entries) if kind is None or entry.job.kind == kind]

    def stats(self) -> dict[str, Any]:
        per_token = self.seconds_per_token
        return {"auxiliary_jobs_queued": len(self.entries), "auxiliary_jobs": dict(self.counts),
                "aux_step_tokens": self.budget, "aux_step_tokens_fixed": bool(self.fixed),
                "aux_ms_per_token": round(per_token * 1000, 4) if per_token is not None else None}
