"""The io thread's last seconds after SIGTERM: the mlx thread's final frames go out, new work is refused.

Before, the engine stopped without a word: every stream ended ~2 s later with "The engine stopped
responding". Now the mlx thread ends each open request with a 503 `engine_shutting_down` ERROR
(`scheduling.inbox.shutdown_events`) and this forwards those frames while it stops (it may write its
hot prefixes to disk for a while), answers ADDs and CALLs that still arrive with the same ERROR and
PINGs with state "draining" (front-ends route nothing new here), then lingers so the frames leave.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from engine_daemon.transport.outbox import forward_outbox
from protocol import MsgType, ProtocolError, decode, encode

log = logging.getLogger(__name__)

STOP_WAIT = 60.0  # seconds the mlx thread gets to stop (`MlxWorker.run`'s shutdown)
LINGER_MS = 2000  # how long the closing ROUTER keeps trying to deliver its last frames
SHUTTING_DOWN = {"status": 503, "code": "engine_shutting_down", "type": "server_error",
                 "message": "The engine is shutting down; retry the request"}


def wind_down(server: Any, router: zmq.Socket, outbox: zmq.Socket) -> None:
    """Runs until the mlx thread has stopped (or STOP_WAIT passed); `server` is the `EngineServer`."""
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(outbox, zmq.POLLIN)
    deadline = time.monotonic() + STOP_WAIT
    while True:
        stopped = not server.worker.is_alive() or time.monotonic() >= deadline
        ready = dict(poller.poll(100))  # once stopped: until its last frames are through the inproc pipe
        if outbox in ready:
            forward_outbox(outbox, lambda peer, frame: server._send(router, peer, frame), limit=None)
        if router in ready:
            for _ in range(1000):
                try:
                    parts = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(parts) == 2:
                    _refuse(router, parts[0], parts[1], server.epoch)
        if stopped and outbox not in ready:
            break
    router.setsockopt(zmq.LINGER, LINGER_MS)


def _refuse(router: zmq.Socket, peer: bytes, frame: bytes, epoch: int) -> None:
    try:
        msg_type, body = decode(frame)
    except ProtocolError:
        return
    if msg_type == MsgType.ADD:
        reply = encode(MsgType.ERROR, {**SHUTTING_DOWN, "rid": body["rid"]})
    elif msg_type == MsgType.CALL:
        reply = encode(MsgType.ERROR, {**SHUTTING_DOWN, "cid": body["cid"]})
    elif msg_type == MsgType.PING:
        reply = encode(MsgType.PONG, {"epoch": epoch, "state": "draining", "queued": 0, "running": 0,
                                      "t": body.get("t", 0)})
    else:
        return
    try:
        router.send_multipart([peer, reply], zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # gone, or not reading: it hears of the stop from the silence
