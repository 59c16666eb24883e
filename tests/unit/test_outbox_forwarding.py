"""`forward_outbox`: the one loop that hands the mlx thread's frames to the ROUTER, bounded while serving."""

from __future__ import annotations

import time

import zmq

from engine_daemon.transport.outbox import forward_outbox


def test_forwards_in_order_bounded_then_until_empty() -> None:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind("inproc://outbox-test")
    push = context.socket(zmq.PUSH)
    push.connect("inproc://outbox-test")
    try:
        for i in range(25):
            push.send_multipart([b"peer%d" % (i % 2), b"frame%d" % i])
        deadline = time.monotonic() + 5
        while not pull.poll(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        got: list[tuple[bytes, bytes]] = []
        assert forward_outbox(pull, lambda peer, frame: got.append((peer, frame)), limit=10) == 10
        assert forward_outbox(pull, lambda peer, frame: got.append((peer, frame)), limit=None) == 15
        assert got == [(b"peer%d" % (i % 2), b"frame%d" % i) for i in range(25)]
        assert forward_outbox(pull, lambda peer, frame: got.append((peer, frame))) == 0
    finally:
        push.close(0)
        pull.close(0)
        context.term()
