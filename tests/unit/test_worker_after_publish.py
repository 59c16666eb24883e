"""The mlx thread sends a step's tokens before that step's deferred work (`BaseScheduler.after_publish`).

Sharing a prompt's KV right after it joined the batch waits for the KV copy of the join, and
the running streams' tokens of that step used to wait with it (`BatchScheduler.after_publish`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import zmq

from engine_daemon.config import SchedulerConfig
from engine_daemon.scheduling.worker import MlxWorker
from protocol import MsgType, decode

OUTBOX = "inproc://test-after-publish"


class OneStepScheduler:
    """Stands in for the scheduler: one step that makes a token, then the step's deferred work."""

    waiting: tuple = ()
    stream = None

    def __init__(self, outbox: zmq.Socket):
        self.outbox = outbox  # read only from the mlx thread, inside `after_publish`
        self.steps = 0
        self.sent_before_deferred_work: list[tuple[MsgType, dict]] = []
        self.deferred_work_done = threading.Event()

    def has_work(self) -> bool:
        return self.steps == 0

    def step(self) -> list:
        self.steps += 1
        return [(b"peer", MsgType.DELTAS, {"rid": "r1", "text": "token"})]

    def after_publish(self) -> None:
        while self.outbox.poll(2000):
            _peer, frame = self.outbox.recv_multipart()
            self.sent_before_deferred_work.append(decode(frame))
            if not self.outbox.poll(0):
                break
        self.deferred_work_done.set()

    def queued(self) -> int:
        return 0

    def running(self) -> int:
        return 1 if self.steps == 0 else 0

    def on_shutdown(self) -> None:
        pass

    def on_unload(self) -> None:
        pass


def test_a_steps_tokens_are_sent_before_its_deferred_work(tmp_path: Path) -> None:
    context = zmq.Context()
    outbox = context.socket(zmq.PULL)
    outbox.bind(OUTBOX)
    try:
        worker = MlxWorker(context, OUTBOX, SchedulerConfig(model_dirs=(tmp_path,)))
        scheduler = OneStepScheduler(outbox)
        worker.scheduler = scheduler  # type: ignore[assignment]
        worker.start()
        assert scheduler.deferred_work_done.wait(30)
        worker.stop()
        worker.join(30)
        [(msg_type, body)] = scheduler.sent_before_deferred_work
        assert msg_type is MsgType.DELTAS and body["items"][0]["rid"] == "r1"
    finally:
        outbox.close(linger=0)
        context.term()
