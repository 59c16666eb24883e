"""The front-end's one connection to `engined`: a DEALER socket, a reader task, heartbeats.

Each worker process owns one EngineClient, created in the ASGI lifespan (never
before gunicorn forks). The reader routes every incoming frame to the collector
of its request; a collector merges pending deltas into one slot, so a slow HTTP
client costs memory bounded by its own output, never a growing queue of frames,
and a client that stops reading altogether is cut off once that slot holds
`max_pending_bytes` (its engine request is aborted). An ADD is packed before it
is registered: one that the wire cannot carry never leaves a stream record behind.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import zmq
import zmq.asyncio

from http_frontend.engine.curve import apply_client_curve
from http_frontend.engine.frames import packed_frame
from http_frontend.engine.handshake_watch import VERSION_MISMATCH, handshake_monitor, version_refusal, watch_handshakes
from http_frontend.engine.loop_time import wait_free_time
from http_frontend.engine.request_stream import EngineError, EngineUnavailable, RequestStream, Update
from protocol import PROTOCOL_VERSION, CallMethod, MsgType, ProtocolError, decode, encode, new_request_id
from protocol.messages import MAX_FRAME_BYTES, PROMPT_LOGPROBS
from protocol.token_ids import FEATURE as PACKED_TOKEN_IDS
from protocol.token_ids import pack_token_ids

__all__ = ["ROUTABLE_STATES", "EngineClient", "EngineError", "EngineLink", "EngineUnavailable", "RequestStream",
           "Update"]

log = logging.getLogger(__name__)

# Engine states (PONG) in which an engine takes new requests; "draining" and "stalled" do not.
ROUTABLE_STATES = frozenset({"ready", "idle", "loading"})
MAX_REMEMBERED_ORPHANS = 4096  # rids already ABORTed as orphans (`EngineClient._abort_orphan`)


@runtime_checkable
class EngineLink(Protocol):
    """What the app uses of its engine client: an `EngineClient`, or a stand-in that routes are tested with.

    `create_app(engine=...)` takes any object with these members; the app's lifespan starts and closes it.
    """

    frontend_id: str
    streams: dict[str, RequestStream]  # this worker's open engine requests, by rid

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def submit(self, request: dict[str, Any]) -> RequestStream: ...

    def release(self, stream: RequestStream, reason: str) -> None: ...

    async def call(self, method: CallMethod | str, args: dict[str, Any] | None = None,
                   timeout: float = 5.0) -> Any: ...


class EngineClient:
    """DEALER connection with HELLO/WELCOME, pings, request routing and generic CALLs."""

    # A dead engine is noticed within dead_after + ping_interval: every open stream ends in < 3 s.
    # `max_pending_bytes`: most unread output one stream may hold before its client is cut off (None: no cap).
    # `engine_id` names the engine to the router (`EnginePool`); `curve_server_key` overrides the shared one.
    def __init__(self, endpoint: str, ping_interval: float = 0.5, dead_after: float = 2.0,
                 max_pending_bytes: int | None = None, engine_id: str = "engine",
                 curve_server_key: str | None = None):
        self.endpoint = endpoint
        self.engine_id = engine_id
        self.curve_server_key = curve_server_key
        self.ping_interval = ping_interval
        self.dead_after = dead_after
        self.max_pending_bytes = max_pending_bytes
        self.frontend_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.epoch: int | None = None
        self.engine_state = "unknown"
        self.model: str | None = None  # the engine's loaded model, as its WELCOME / PONG last said
        self.features: frozenset[str] = frozenset()  # what the engine's WELCOME says it reads (`protocol.token_ids`)
        self.refusal: str | None = None  # why the engine refused this front-end's HELLO (another protocol version)
        self.queued = 0  # the engine's queue and running requests at its last PONG (every front-end's)
        self.running = 0
        self._others_load = 0  # of those, the ones not this worker's: the rest of the load is counted here
        self.last_heard = 0.0
        self.received_bytes = 0  # of frames read from the engine, sent as `rx` in PINGs (the engine's unread cap)
        # When the oldest ping still followed by no frame at all was sent (None before the first ping).
        self._unanswered_since: float | None = None
        self.streams: dict[str, RequestStream] = {}
        self._calls: dict[str, asyncio.Future] = {}
        # Long CALLs (audio): partial RESULTs go to their callback; an engine that dies fails them at once.
        self._partials: dict[str, Callable[[Any], None] | None] = {}
        # rids this worker no longer follows whose output the engine sent anyway (an ADD that landed after its
        # client gave up, a frozen engine resumed): each gets one ABORT (`_abort_orphan`), remembered a while.
        self._orphans: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._ready = asyncio.Event()
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def alive(self) -> bool:
        return self._ready.is_set() and self._silent_for() < self.dead_after

    @property
    def routable(self) -> bool:
        """Takes new requests: answers pings, not stalled, not draining (rolling restarts)."""
        return self.alive and self.engine_state in ROUTABLE_STATES

    @property
    def load(self) -> int:
        """queued + running now: other front-ends' share as of the last PONG, this worker's counted live.

        PONGs come every half second; a burst from this worker must see its own requests at once.
        """
        return self._others_load + len(self.streams)

    def _silent_for(self) -> float:
        """Seconds since a ping that no frame has followed was sent; 0 while every ping got an answer.

        Silence counts from a ping actually sent, not from the last frame heard: a worker whose
        event loop was busy (a large body being parsed) sent no pings meanwhile, and must not
        take the engine's quiet for its death.
        """
        since = self._unanswered_since
        if since is None or self.last_heard >= since:
            return 0.0
        return time.monotonic() - since

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue frames for an engine that is not there
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # CURVE client when MLX_FRONTEND_CURVE_* are set (across hosts); this engine's own server key if given
        curve = apply_client_curve(sock, server_key=self.curve_server_key)
        monitor = handshake_monitor(sock) if curve else None  # a wrong key would look like a dead engine: say why
        sock.connect(self.endpoint)
        self._socket = sock
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._heartbeat_loop())]
        if monitor is not None:
            self._tasks.append(asyncio.create_task(watch_handshakes(sock, monitor, self.endpoint)))
        log.info("front-end %s connecting to engine at %s", self.frontend_id, self.endpoint)

    async def close(self) -> None:
        self._send(MsgType.BYE, {})
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(0)
        if self._context is not None:
            self._context.term()

    # -- sending ---------------------------------------------------------------------
    def _send(self, msg_type: MsgType, body: dict[str, Any]) -> bool:
        """Non-blocking send; False when no engine is connected to take it."""
        return self._send_frame(encode(msg_type, body))

    def _send_frame(self, frame: bytes) -> bool:
        if self._socket is None:
            return False
        # With NOBLOCK the asyncio socket finishes the send at once and returns a done Future:
        # read its outcome here (an unread exception would only be logged as "never retrieved").
        # Sending through a sync shadow socket instead would skip pyzmq's edge-triggered event
        # bookkeeping and can leave the reader asleep with frames waiting.
        sent = self._socket.send(frame, zmq.NOBLOCK)
        if sent.done() and sent.exception() is not None:
            if not isinstance(sent.exception(), zmq.Again):
                log.warning("send to the engine failed: %s", sent.exception())
            return False
        return True

    def _unreachable(self) -> EngineUnavailable:
        return EngineUnavailable(self.refusal or "The engine is not reachable")

    async def wait_ready(self, timeout: float) -> bool:
        if self.alive:
            return True
        if self.refusal is not None:  # refused until one side is upgraded: waiting changes nothing
            return False
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return self.alive

    async def submit(self, request: dict[str, Any]) -> RequestStream:
        """Sends ADD; the returned stream gets ACCEPTED, deltas or an error.

        UnsendableRequest when the ADD cannot be packed into one frame (nothing is registered then).
        """
        if not await self.wait_ready(2.0):
            raise self._unreachable()
        rid = new_request_id(self.frontend_id)
        stream = RequestStream(rid, self.max_pending_bytes)
        if (request.get("params") or {}).get(PROMPT_LOGPROBS) is not None and PROMPT_LOGPROBS not in self.features:
            # An engine from before prompt logprobs would ignore the param and answer without them.
            stream.on_error({"rid": rid, "status": 400, "code": "unsupported_parameter", "param": "logprobs",
                             "type": "invalid_request_error", "message": "The engine serving this request does not "
                             "compute prompt logprobs (it predates them): upgrade it to use 'echo' with 'logprobs'"})
            return stream
        frame = packed_frame(MsgType.ADD, {**self._packed(request), "rid": rid, "epoch": self.epoch})
        self.streams[rid] = stream
        if not self._send_frame(frame):
            del self.streams[rid]
            raise self._unreachable()
        return stream

    def _packed(self, request: dict[str, Any]) -> dict[str, Any]:
        """`request` with a token prompt packed (`protocol.token_ids`) when the engine reads that: its io thread
        then copies one binary where it made an int per id (0.12 s for 6.5 M ids, every stream waiting)."""
        prompt = request.get("prompt")
        if not isinstance(prompt, list) or PACKED_TOKEN_IDS not in self.features:
            return request
        packed = pack_token_ids(prompt)
        # Four bytes an id where msgpack writes one for ids below 128: a list that packs past half a frame goes
        # as it is (it is millions of ids, which the engine refuses by their count).
        return request if packed is None or len(packed) > MAX_FRAME_BYTES // 2 else {**request, "prompt": packed}

    def release(self, stream: RequestStream, reason: str) -> None:
        """Forget a request; ABORT it unless it already finished. Idempotent."""
        self.streams.pop(stream.rid, None)
        if not stream.finished:
            stream.finished = True
            self._send(MsgType.ABORT, {"rids": [stream.rid], "reason": reason})
            self._remember_aborted(stream.rid)  # its output still in flight is dropped without a second ABORT

    def _cut_off(self, stream: RequestStream) -> None:
        """A client that left more than `max_pending_bytes` unread: abort its request and free what it held."""
        log.warning("rid=%s: %d bytes of output left unread (limit %d): cutting the client off", stream.rid,
                    stream.pending_bytes, self.max_pending_bytes)
        self.release(stream, "slow_client")
        stream.on_error({"rid": stream.rid, "status": 408, "code": "slow_client", "type": "invalid_request_error",
                         "message": f"The client read the stream too slowly: more than {self.max_pending_bytes} "
                                    "bytes of output waited unread, so the request was stopped"})

    async def call(self, method: CallMethod | str, args: dict[str, Any] | None = None,
                   timeout: float = 5.0) -> Any:
        """Generic request/reply to the engine (`CallMethod`: status, list_models, unload, ...)."""
        return await self._call(method, args, timeout, None, streaming=False)

    async def call_streaming(self, method: CallMethod | str, args: dict[str, Any] | None = None,
                             timeout: float = 600.0, on_partial: Callable[[Any], None] | None = None) -> Any:
        """A long CALL (transcription, speech): `on_partial` gets each partial RESULT's value as it arrives.

        The engine answers with any number of RESULTs marked `partial` (a transcript segment, a
        piece of audio) before the final one, which this returns. Unlike a plain CALL, it fails
        at once with EngineUnavailable when the engine is lost, not at its timeout.
        """
        return await self._call(method, args, timeout, on_partial, streaming=True)

    async def _call(self, method: CallMethod | str, args: dict[str, Any] | None, timeout: float,
                    on_partial: Callable[[Any], None] | None, streaming: bool) -> Any:
        method = method.value if isinstance(method, CallMethod) else method  # the plain name, in errors too
        if self.engine_state == "unreachable":  # known down: /health and /v1/models answer now, not in 2 s
            raise self._unreachable()
        if not await self.wait_ready(min(timeout, 2.0)):
            raise self._unreachable()
        cid = uuid.uuid4().hex
        frame = packed_frame(MsgType.CALL, {"cid": cid, "method": method, "args": args or {}})
        future = asyncio.get_running_loop().create_future()
        self._calls[cid] = future
        if streaming:
            self._partials[cid] = on_partial
        try:
            if not self._send_frame(frame):
                raise self._unreachable()
            return await wait_free_time(future, timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"The engine did not answer '{method}' within {timeout:.0f} s") from None
        except asyncio.CancelledError:  # the client left: a long CALL's job is dropped (ABORT names its cid)
            if streaming:
                self._send(MsgType.ABORT, {"rids": [cid], "reason": "client"})
            raise
        finally:
            self._calls.pop(cid, None)
            self._partials.pop(cid, None)

    # -- receiving -------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            frame = await self._socket.recv()
            self.last_heard = time.monotonic()  # any frame is a sign of life, not only PONG
            self.received_bytes += len(frame)  # told to the engine in each PING: it bounds what we leave unread
            try:
                msg_type, body = decode(frame)
            except ProtocolError as exc:
                log.warning("dropping a bad frame from the engine: %s", exc)
                continue
            try:
                self._dispatch(msg_type, body)
            except Exception:
                log.exception("failed to route %s", msg_type.name)

    def _dispatch(self, msg_type: MsgType, body: dict[str, Any]) -> None:
        if msg_type == MsgType.DELTAS:
            for item in body["items"]:
                stream = self.streams.get(item["rid"])
                if stream is None:
                    if not item.get("finish_reason"):
                        self._abort_orphan(item["rid"])
                    continue
                stream.on_deltas(item)
                if stream.finished:
                    self.streams.pop(stream.rid, None)
                elif stream.over_limit:
                    self._cut_off(stream)
        elif msg_type == MsgType.ACCEPTED:
            stream = self.streams.get(body["rid"])
            if stream is not None:
                stream.on_accepted(body)
            else:
                self._abort_orphan(body["rid"])
        elif msg_type == MsgType.ERROR:
            self._on_error(body)
        elif msg_type == MsgType.RESULT:
            if body.get("partial"):  # a piece of a long CALL's answer
                callback = self._partials.get(body["cid"])
                if callback is not None:
                    callback(body.get("result"))
                return
            future = self._calls.get(body["cid"])
            if future is not None and not future.done():
                future.set_result(body.get("result"))
        elif msg_type in (MsgType.PONG, MsgType.WELCOME):
            self._on_engine_state(body)

    def _abort_orphan(self, rid: str) -> None:
        """Output for a request nobody here follows: ABORT it once, so it stops holding a slot."""
        if not isinstance(rid, str) or rid in self._orphans:
            return
        self._remember_aborted(rid)
        log.info("rid=%s: the engine runs a request this worker gave up on: aborting it", rid)
        self._send(MsgType.ABORT, {"rids": [rid], "reason": "orphaned"})

    def _remember_aborted(self, rid: str) -> None:
        self._orphans[rid] = None
        if len(self._orphans) > MAX_REMEMBERED_ORPHANS:
            self._orphans.popitem(last=False)

    def _on_error(self, body: dict[str, Any]) -> None:
        rid, cid = body.get("rid"), body.get("cid")
        if body.get("code") == VERSION_MISMATCH and not rid and not cid:
            self._refused(body.get("message") or "")
            return
        if body.get("code") == "frontend_dropped":  # the engine aborted all of ours after our silence
            log.warning("the engine dropped this worker after its silence: failing %d open request(s)",
                        len(self.streams))
            self._fail_all(503, "engine_unavailable", body.get("message") or "The engine dropped this front-end")
            return
        if rid and rid in self.streams:
            self.streams.pop(rid).on_error(body)
        elif cid and cid in self._calls:
            future = self._calls[cid]
            if not future.done():
                future.set_exception(EngineError(body))
        else:
            log.warning("engine error: %s (%s)", body.get("message"), body.get("code"))

    def _refused(self, message: str) -> None:
        """The engine refused our HELLO: it ignores this worker from now on, so it is down here, and says why."""
        refusal = version_refusal(self.engine_id, message)
        if refusal != self.refusal:
            log.error("%s (at %s)", refusal, self.endpoint)
        self.refusal = refusal
        self._ready.clear()
        self.engine_state = "unreachable"
        self._fail_all(503, "engine_unavailable", refusal)

    def _on_engine_state(self, body: dict[str, Any]) -> None:
        epoch = body["epoch"]
        if epoch != self.epoch:
            self.refusal = None  # another engine process: it may speak our version (the HELLO below tells)
        if self.epoch is not None and epoch != self.epoch:
            log.warning("engine restarted (epoch %s -> %s): failing %d open request(s)",
                        self.epoch, epoch, len(self.streams))
            self._fail_all(503, "engine_restarted", "The engine restarted while this request ran")
        if epoch != self.epoch:
            self.features = frozenset()  # another engine process: its WELCOME says what it reads
            self._send(MsgType.HELLO, self._hello())
        self.epoch = epoch
        if isinstance(body.get("features"), list):
            self.features = frozenset(name for name in body["features"] if isinstance(name, str))
        self.engine_state = body["state"]
        if "model" in body:
            self.model = body["model"]
        if "queued" in body:
            self.queued, self.running = body["queued"], body.get("running", 0)
            self._others_load = max(0, self.queued + self.running - len(self.streams))
        self.last_heard = time.monotonic()
        self._ready.set()

    def _hello(self) -> dict[str, Any]:
        return {"version": PROTOCOL_VERSION, "frontend_id": self.frontend_id, "pid": os.getpid(),
                "host": socket.gethostname()}

    def _fail_all(self, status: int, code: str, message: str) -> None:
        """Every open request and CALL ends now; the engine is told to ABORT the requests.

        A frozen engine (SIGSTOP, a paused VM) reads the ABORTs when it resumes, before it would
        spend a step on requests whose clients already got this error.
        """
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineUnavailable(message))
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.on_error({"rid": stream.rid, "status": status, "code": code, "message": message,
                             "type": "server_error"})
        if streams:
            self._send(MsgType.ABORT, {"rids": list(streams), "reason": "engine_unavailable"})
            for rid in streams:
                self._remember_aborted(rid)

    async def _heartbeat_loop(self) -> None:
        self._send(MsgType.HELLO, self._hello())
        while True:
            if self._silent_for() == 0.0:  # every earlier ping was answered: silence counts from this one
                self._unanswered_since = time.monotonic()
            self._send(MsgType.PING, {"t": time.time(), "rx": self.received_bytes})
            await asyncio.sleep(self.ping_interval)
            if self._ready.is_set() and not self.alive and not self._socket.get(zmq.EVENTS) & zmq.POLLIN:
                # Frames still waiting to be read mean this worker is behind, not the engine dead.
                log.warning("engine silent for %.1f s: marking it down", self.dead_after)
                self._ready.clear()
                self.engine_state = "unreachable"
                self._fail_all(503, "engine_unavailable", "The engine stopped responding")
            elif not self._ready.is_set() and self.engine_state == "unknown" and self._silent_for() >= self.dead_after:
                # Never answered (this worker started while it was down): known down, so CALLs to it (/v1/models,
                # /health, each engine's) fail at once as for an engine that died, not after a 2 s wait each.
                log.warning("engine at %s has not answered for %.1f s: down until it does", self.endpoint,
                            self.dead_after)
                self.engine_state = "unreachable"
