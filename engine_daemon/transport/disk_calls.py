"""CALLs that read the disk (`Thread.DISK`: the model catalogue), answered on a thread of their own.

On the io thread, `list_models` (a scan of --model-dir and the Hugging Face cache) held every stream's
frames for as long as the disk took: they all go through that thread, and every front-end worker asks
every engine for the catalogue at its start and every 10 minutes. On the mlx thread it would wait for
each step, or for a model load. Here one thread runs them in turn, and its answers reach the peers as
the mlx thread's frames do: through the inproc outbox, forwarded by the io thread (`forward_outbox`).

Each answer goes out on a PUSH socket made for it: a scan still running at shutdown holds no socket, so
it cannot hold up the context's termination (the thread is a daemon, and its late answer is dropped).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq

from engine_daemon.errors import SHUTTING_DOWN, RequestError, engine_failure
from protocol import MsgType, encode

log = logging.getLogger(__name__)

MAX_WAITING = 256  # CALLs waiting for the thread; more are refused (429) by the io thread
REPLY_LINGER_MS = 1000  # an answer's socket, closed at once, still delivers its frame
BUSY = RequestError(429, "queue_full", "The engine has too many catalogue requests waiting; retry later",
                    error_type="rate_limit_error")

Handler = Callable[[Any, dict[str, Any]], Any]  # (the engine server, args) -> result, as an io-thread CALL's


class DiskCalls:
    """A thread for the CALLs that read the disk; `submit` from the io thread, answers through the outbox."""

    def __init__(self, context: zmq.Context, outbox_address: str, ctx: Any):
        self._context = context
        self._outbox_address = outbox_address
        self._ctx = ctx  # what the handlers read: the engine server (`calls.io_thread.IoContext`)
        self._waiting: queue.Queue[tuple[bytes, str, Handler, dict[str, Any]] | None] = queue.Queue(MAX_WAITING)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="disk-calls", daemon=True)
        self._thread.start()

    def submit(self, peer: bytes, cid: str, handler: Handler, args: dict[str, Any]) -> dict[str, Any] | None:
        """Queues one CALL; the ERROR body to answer at once when too many wait (or the thread has stopped)."""
        if self._stopping.is_set():
            return {**SHUTTING_DOWN.to_body(None), "cid": cid}
        try:
            self._waiting.put_nowait((peer, cid, handler, args))
        except queue.Full:
            return {**BUSY.to_body(None), "cid": cid}
        return None

    def stop(self) -> None:
        """SIGTERM: CALLs still waiting are answered with `SHUTTING_DOWN`; the one running finishes if it can."""
        self._stopping.set()
        try:
            self._waiting.put_nowait(None)
        except queue.Full:
            pass  # the thread sees `_stopping` after its current CALL and answers the rest so

    def _run(self) -> None:
        while True:
            item = self._waiting.get()
            if item is None:
                return
            peer, cid, handler, args = item
            if self._stopping.is_set():
                self._send(peer, MsgType.ERROR, {**SHUTTING_DOWN.to_body(None), "cid": cid})
                continue
            try:
                self._send(peer, MsgType.RESULT, {"cid": cid, "result": handler(self._ctx, args)})
            except RequestError as exc:
                self._send(peer, MsgType.ERROR, {**exc.to_body(None), "cid": cid})
            except Exception as exc:  # a bug in one CALL must not stop the thread, nor leave the caller waiting
                log.exception("CALL %s failed on the disk-calls thread", getattr(handler, "__name__", handler))
                self._send(peer, MsgType.ERROR, {**engine_failure(exc).to_body(None), "cid": cid})

    def _send(self, peer: bytes, msg_type: MsgType, body: dict[str, Any]) -> None:
        frame = encode(msg_type, body)  # a result it cannot encode: the ERROR of `_run`
        try:
            push = self._context.socket(zmq.PUSH)
        except zmq.ZMQError:
            return  # the engine has stopped (its context terminated): no one to answer
        try:
            push.setsockopt(zmq.LINGER, REPLY_LINGER_MS)
            push.connect(self._outbox_address)
            push.send_multipart([peer, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("a disk-call's answer was dropped: %s", exc)
        finally:
            push.close()
