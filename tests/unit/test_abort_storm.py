"""An ABORT storm cannot hold the mlx thread between two steps (red team E9).

570k ABORT frames in 20 s were handled one by one before every step: a victim's stream slowed 3.6
times. The mlx thread now takes a bounded number of commands per step, ABORTs merged, so a running
request keeps getting steps (counted here by the scheduler, engine-side) and every abort still lands.
"""

from __future__ import annotations

import threading
from pathlib import Path

import zmq

from engine_daemon.config import SchedulerConfig
from engine_daemon.scheduling.commands import AbortCommand, AddCommand
from engine_daemon.scheduling.inbox import MAX_COMMANDS_PER_STEP
from engine_daemon.scheduling.worker import MlxWorker

OUTBOX = "inproc://test-abort-storm"
STORM = 20_000  # ABORT commands waiting before the first step, 50 ids each


class CountingScheduler:
    """A victim stream of `tokens` steps; records how much of the storm was handled before each step."""

    waiting: tuple = ()
    stream = None

    def __init__(self, worker: MlxWorker, tokens: int):
        self.worker = worker
        self.tokens = tokens
        self.steps = 0
        self.aborted: set[str] = set()
        self.abort_calls = 0
        self.storm_left_at_step: list[int] = []  # commands still queued as each step ran
        self.done = threading.Event()

    def has_work(self) -> bool:
        return self.steps < self.tokens

    def step(self) -> list:
        self.steps += 1
        self.storm_left_at_step.append(self.worker.commands.qsize())
        if self.steps == self.tokens:
            self.done.set()
        return []

    def owned_by(self, peer: bytes, rids: set[str]) -> tuple[set[str], set[str]]:
        return rids, set()

    def abort(self, rids: set[str]) -> int:
        self.abort_calls += 1
        self.aborted |= rids
        return 0

    def submit(self, peer: bytes, body: dict, prepared: object) -> list:
        return []

    def after_publish(self) -> None:
        pass

    def queued(self) -> int:
        return 0

    def running(self) -> int:
        return int(self.has_work())

    def on_shutdown(self) -> None:
        pass

    def on_unload(self) -> None:
        pass


def test_a_storm_of_aborts_does_not_stop_the_steps_and_none_is_lost(tmp_path: Path) -> None:
    context = zmq.Context()
    outbox = context.socket(zmq.PULL)
    outbox.bind(OUTBOX)
    try:
        worker = MlxWorker(context, OUTBOX, SchedulerConfig(model_dirs=(tmp_path,)))
        scheduler = CountingScheduler(worker, tokens=STORM // MAX_COMMANDS_PER_STEP + 40)
        worker.scheduler = scheduler  # type: ignore[assignment]
        worker.commands.put(AddCommand(b"victim", {"rid": "victim"}))
        for i in range(STORM):
            worker.commands.put(AbortCommand([f"x:{i}:{j}" for j in range(50)], "storm", b"evil"))
        worker.start()
        assert scheduler.done.wait(60)
        worker.stop()
        worker.join(30)
        # The victim's first step came after at most one step's share of the storm, not after all of it.
        assert scheduler.storm_left_at_step[0] >= STORM - MAX_COMMANDS_PER_STEP
        # ... and it kept stepping while the storm was being handled.
        assert sum(left > 0 for left in scheduler.storm_left_at_step) >= STORM // MAX_COMMANDS_PER_STEP - 1
        # No abort lost; merged: one scheduler abort per step's share, not one per frame.
        assert len(scheduler.aborted) == STORM * 50
        assert scheduler.abort_calls <= STORM // MAX_COMMANDS_PER_STEP + 2
    finally:
        outbox.close(linger=0)
        context.term()


def test_merged_aborts_still_end_only_their_senders_requests() -> None:
    from engine_daemon.scheduling.inbox import PendingAborts

    class Owners:
        owner = {"a:1": b"a", "b:1": b"b"}
        aborted: set[str] = set()

        def owned_by(self, peer: bytes, rids: set[str]) -> tuple[set[str], set[str]]:
            known = {rid for rid in rids if rid in self.owner}
            mine = {rid for rid in known if self.owner[rid] == peer}
            return mine, known - mine

        def abort(self, rids: set[str]) -> int:
            self.aborted |= rids
            return len(rids)

    class NoJobs:
        def has_work(self) -> bool:
            return False

    scheduler = Owners()
    PendingAborts(AbortCommand(["a:1", "b:1"], "client", b"a"), AbortCommand(["x"], "client", b"b")).apply(
        scheduler, NoJobs())
    assert scheduler.aborted == {"a:1"}
