"""The io thread: owns the ROUTER socket, knows the peers, answers pings, dispatches.

Pings are answered here, never on the mlx thread, so a long prefill or a model
load is not mistaken for a dead engine. Frames are validated by `protocol`
before anything reaches the mlx thread; a malformed frame is answered with an
ERROR when it names a request or call, and otherwise dropped and logged.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import zmq

from engine_daemon.calls.response_store import ResponseStore
from engine_daemon.calls.table import Thread, lookup
from engine_daemon.config import SchedulerConfig
from engine_daemon.errors import SHUTTING_DOWN, RequestError, clipped
from engine_daemon.group.settings import GroupSettings
from engine_daemon.models import store as model_store
from engine_daemon.multimodal.inputs import prepare_media_inputs
from engine_daemon.request.preprocess import Preprocessor
from engine_daemon.scheduling.commands import (
    AbortCommand,
    AddCommand,
    AuxiliaryCommand,
    CallCommand,
    PeerGoneCommand,
    ReplyCommand,
)
from engine_daemon.scheduling.worker import MlxWorker
from engine_daemon.transport.disk_calls import DiskCalls
from engine_daemon.transport.handshake_log import HandshakeLog, QuietLog, folded
from engine_daemon.transport.outbox import forward_outbox
from engine_daemon.transport.security import SocketSecurity, ThreadAuthenticator, secure_router
from engine_daemon.transport.wind_down import wind_down
from protocol import PROMPT_LOGPROBS, PROTOCOL_VERSION, MsgType, ProtocolError, decode, encode
from protocol.token_ids import FEATURE as PACKED_TOKEN_IDS

log = logging.getLogger(__name__)

OUTBOX_ADDRESS = "inproc://mlx-outbox"
GROUP_STOP_GRACE = 0.5  # seconds between SIGTERM and a group's clean stop (`EngineServer.stop`)
SEND_HWM = 100_000
INBOUND_BATCH = 1000  # frames read per turn of the io loop
# A turn that read a whole batch (a flood, e.g. 28k ABORT frames/s) is followed by a pause this many times as long:
# decoding them held the GIL and the steps of every stream slowed 3-4 times; a front-end never sends this many.
FLOOD_YIELD = 2.0
PEER_MAX_QUEUED_BYTES = 64 * 2**20  # --peer-max-queued: output one front-end may leave unread
MAX_REFUSED_PEERS = 4096
BAD_FRAME_QUIET = 10.0  # seconds between two log lines about one peer's bad frames (the others are counted)


class EndpointInUse(RuntimeError):
    """Another engine holds the ipc endpoint's lock."""


@dataclass
class Peer:
    frontend_id: str
    last_seen: float
    pid: int | None = None
    host: str | None = None
    sent_bytes: int = 0  # frames sent to it since this record was made
    rx_base: int | None = None  # its first PING's `rx` (bytes it had read by then); None: it never said
    rx: int = 0  # its latest PING's `rx`

    def unread(self) -> int:
        """Bytes sent that it has not said it read; 0 for a peer whose PINGs carry no `rx` (a front-end of an
        older release, which must keep streaming through an engine upgraded first: only SEND_HWM bounds it)."""
        return self.sent_bytes - (self.rx - self.rx_base) if self.rx_base is not None else 0


def lock_ipc_endpoint(endpoint: str) -> BinaryIO | None:
    """Takes `<socket>.lock` so a second engine cannot silently steal the ipc path.

    The socket directory is created private (0700): only this user can connect.
    """
    if not endpoint.startswith("ipc://"):
        return None
    path = Path(endpoint[len("ipc://"):])
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = open(f"{path}.lock", "wb")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise EndpointInUse(f"another engine is bound to {endpoint}") from None
    if path.exists():
        path.unlink()  # a stale socket of a dead engine: we hold the lock, so it is ours
    return lock


class EngineServer:
    """Binds the endpoint, runs the mlx worker, routes frames both ways until stopped."""

    def __init__(self, endpoint: str, config: SchedulerConfig, preload: str | None = None,
                 peer_timeout: float = 10.0, stall_timeout: float = 60.0,
                 security: SocketSecurity | None = None, responses: ResponseStore | None = None,
                 group: tuple[GroupSettings, object] | None = None,
                 peer_max_queued: int = PEER_MAX_QUEUED_BYTES):
        self.endpoint = endpoint
        self.peer_max_queued = peer_max_queued
        self.peer_timeout = peer_timeout
        self.stall_timeout = stall_timeout
        self.epoch = time.time_ns() // 1000
        self.started_at = time.time()
        self.peers: dict[bytes, Peer] = {}
        # Peers whose HELLO named another protocol version: dropped until a correct HELLO.
        self.refused: set[bytes] = set()
        self.dropped: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # swept for silence: when
        self.context = zmq.Context()
        self.worker = MlxWorker(self.context, OUTBOX_ADDRESS, config, preload, group)
        self.preprocessor = Preprocessor(
            lambda: self.worker.models.current,
            lambda peer, body, prepared: self.worker.commands.put(AddCommand(peer, body, prepared)),
            decode_media=prepare_media_inputs, max_queued=config.max_queued)
        self.disk_calls = DiskCalls(self.context, OUTBOX_ADDRESS, self)  # `list_models`: reads the disk
        self.worker.offload = self.preprocessor.run_call  # auxiliary jobs' tokenizing / decoding, off the mlx thread
        self._stop = threading.Event()
        self._lock: BinaryIO | None = None
        self.security = security or SocketSecurity()
        self._auth: ThreadAuthenticator | None = None
        # Responses API records (previous_response_id, GET, DELETE): touched on the io thread only.
        self.responses = responses if responses is not None else ResponseStore()
        self._load_reported = 0  # seconds of the current model load already logged (_report_loading)
        self.failed = False  # set when the mlx thread died: `engined` then exits non-zero
        self.draining = False  # `calls.drain`: PONGs say "draining" so front-ends route no new work here
        self._cut_off: collections.OrderedDict[bytes, Peer] = collections.OrderedDict()  # over --peer-max-queued
        self._bad_frames = QuietLog(BAD_FRAME_QUIET, MAX_REFUSED_PEERS)  # 87 MB of log in 20 s of garbage frames

    def stop(self) -> None:
        if self.worker.group is not None:
            # A launcher stops rank 0 right after a follower died (mlx.launch does): a moment's grace lets the
            # closed connection register as the group failure it is (streams end with engine_group_failed and
            # /health names the rank) instead of a clean stop. Signal handlers must return at once: a timer.
            threading.Timer(GROUP_STOP_GRACE, self._stop_group).start()
            return
        self._stop.set()

    def _stop_group(self) -> None:
        if self.worker.group.failed:
            # A failed group's rank 0 keeps answering /health (which rank failed) until its own exit.
            log.info("stop requested while the group failed: exiting after --group-exit-delay")
            return
        self.worker.group.stopping()  # followers leaving from now on is the shutdown, not a fault
        self._stop.set()

    def serve(self) -> None:
        self._lock = lock_ipc_endpoint(self.endpoint)
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, SEND_HWM)
        router.setsockopt(zmq.LINGER, 0)
        self._auth = secure_router(self.context, router, self.endpoint, self.security)  # CURVE + ZAP allow-list
        router.bind(self.endpoint)
        outbox = self.context.socket(zmq.PULL)
        outbox.bind(OUTBOX_ADDRESS)
        self.worker.start()
        self.disk_calls.start()
        log.info("engine epoch %d listening on %s (pid %d)", self.epoch, self.endpoint, os.getpid())
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        handshakes = HandshakeLog(router) if self._auth is not None else None  # why a CURVE peer was refused
        if handshakes is not None:
            poller.register(handshakes.monitor, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(200))
                if outbox in ready:
                    forward_outbox(outbox, lambda peer, frame: self._send(router, peer, frame))
                if router in ready:
                    started = time.perf_counter()
                    for _ in range(INBOUND_BATCH):
                        try:
                            parts = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(router, parts)
                    else:  # a flood: the mlx thread gets the GIL twice as long (the senders wait at RCVHWM)
                        time.sleep(FLOOD_YIELD * (time.perf_counter() - started))
                if handshakes is not None and handshakes.monitor in ready:
                    handshakes.drain()
                if not self.worker.is_alive():
                    # A dead mlx thread would leave every stream hanging behind a live socket:
                    # stop now, and let the exit status tell the supervisor to restart us.
                    log.critical("the mlx thread died: stopping the engine")
                    self.failed = True
                    break
                if time.monotonic() >= next_sweep:
                    self._sweep_peers()
                    self._report_loading()
                    next_sweep = time.monotonic() + 1.0
        finally:
            for peer, rid in self.preprocessor.close():  # its ADDs (its CALLs are answered through the mlx thread)
                self._reply(router, peer, MsgType.ERROR, SHUTTING_DOWN.to_body(rid))
            self.disk_calls.stop()
            self.worker.stop()
            # Its last frames (every open request's engine_shutting_down) go out while it stops; a clean stop
            # writes the hot prefixes to --prompt-cache-dir.
            wind_down(self, router, outbox)
            self.worker.join(timeout=1)
            if handshakes is not None:
                handshakes.close()
            router.close()
            outbox.close()
            if self._auth is not None:
                self._auth.stop()  # its sockets would keep context.term() waiting
            self.context.term()
            if self._lock is not None:
                self._lock.close()
            log.info("engine stopped")

    # -- sending ---------------------------------------------------------------
    def _send(self, router: zmq.Socket, peer: bytes, frame: bytes) -> None:
        try:
            router.send_multipart([peer, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer is gone (ROUTER_MANDATORY); EAGAIN: it stopped reading.
            log.warning("dropping front-end %r: %s", peer, exc)
            self._peer_gone(peer)
            return
        known = self.peers.get(peer)
        if known is not None:
            known.sent_bytes += len(frame)
            if known.unread() > self.peer_max_queued:
                self._drop_unread(peer, known)

    def _drop_unread(self, peer: bytes, known: Peer) -> None:
        """A front-end that leaves more than --peer-max-queued of output unread: ZeroMQ would queue up to
        SEND_HWM frames for it (GBs of DELTAS); its requests are aborted, as the front-end's slow-client cap does
        for an HTTP client, and its next frame hears `frontend_dropped`."""
        self._warn_peer(peer, "unread", "front-end %s left %.0f MiB of output unread (over --peer-max-queued %.0f "
                        "MiB): aborting its requests", clipped(known.frontend_id) or repr(peer),
                        known.unread() / 2**20, self.peer_max_queued / 2**20)
        self._peer_gone(peer)
        self._remember_dropped(peer)
        self._cut_off[peer] = known
        if len(self._cut_off) > MAX_REFUSED_PEERS:
            self._cut_off.popitem(last=False)

    def _new_peer(self, peer: bytes, record: Peer) -> Peer:
        """`record` as what we know of `peer`; the output it left unread when it was cut off still counts, so a
        peer that goes on not reading has its next requests cut at once (its ZeroMQ queue is not emptied)."""
        cut = self._cut_off.pop(peer, None)
        if cut is not None:
            record.sent_bytes, record.rx_base, record.rx = cut.sent_bytes, cut.rx_base, cut.rx
        self.peers[peer] = record
        return record

    def _remember_dropped(self, peer: bytes) -> None:
        self.dropped[peer] = time.monotonic()  # told so if it speaks again (`_receive`)
        if len(self.dropped) > MAX_REFUSED_PEERS:
            self.dropped.popitem(last=False)

    def _reply(self, router: zmq.Socket, peer: bytes, msg_type: MsgType, body: dict[str, Any]) -> None:
        self._send(router, peer, encode(msg_type, body))

    # -- receiving ---------------------------------------------------------------
    def _warn_peer(self, peer: bytes, kind: str, message: str, *args: Any) -> None:
        """A warning about what a peer sent, at most one per peer and kind every `BAD_FRAME_QUIET` seconds."""
        more = self._bad_frames.allow((peer, kind))
        if more is not None:
            log.warning(message + "%s", *args, folded(more))

    def _receive(self, router: zmq.Socket, parts: list[bytes]) -> None:
        if len(parts) != 2:
            self._warn_peer(parts[0] if parts else b"", "frames", "dropping a message of %d frames from %r "
                            "(expected identity + 1)", len(parts), parts[0] if parts else b"")
            return
        peer, frame = parts
        try:
            msg_type, body = decode(frame)
        except ProtocolError as exc:
            self._warn_peer(peer, "bad", "bad frame from %r: %s", peer, clipped(str(exc), 300))
            if exc.rid or exc.cid:
                self._reply(router, peer, MsgType.ERROR, {
                    "rid": exc.rid, "cid": exc.cid, "status": 400, "code": "bad_frame",
                    "message": str(exc), "type": "invalid_request_error", "param": exc.param})
            return
        if peer in self.refused and msg_type != MsgType.HELLO:
            return  # its HELLO was refused: nothing but a correct HELLO is heard from it
        known = self.peers.get(peer)
        if known is not None:
            known.last_seen = time.monotonic()
        elif self.dropped.pop(peer, None) is not None and msg_type not in (MsgType.HELLO, MsgType.BYE):
            # It was silent, not gone (a paused worker): its clients still wait on what the sweep aborted.
            self._reply(router, peer, MsgType.ERROR, {
                "status": 503, "code": "frontend_dropped", "type": "server_error",
                "message": f"The engine stopped this front-end's requests after {self.peer_timeout:.0f} s "
                           "without a word from it"})
        handler = getattr(self, f"_on_{msg_type.name.lower()}", None)
        if handler is None:
            self._warn_peer(peer, "type", "dropping %s from %r: not a front-end message", msg_type.name, peer)
            return
        handler(router, peer, body)

    def _on_hello(self, router: zmq.Socket, peer: bytes, body: dict[str, Any]) -> None:
        if body["version"] != PROTOCOL_VERSION:
            if len(self.refused) >= MAX_REFUSED_PEERS:
                self.refused.pop()  # bounded memory against a client cycling identities
            self.refused.add(peer)
            self.peers.pop(peer, None)
            self._warn_peer(peer, "version", "front-end %s speaks protocol %s: refused until it says HELLO with %d",
                            clipped(body.get("frontend_id")), body["version"], PROTOCOL_VERSION)
            self._reply(router, peer, MsgType.ERROR, {
                "status": 400, "code": "protocol_version_mismatch", "type": "invalid_request_error",
                "message": f"engine speaks protocol {PROTOCOL_VERSION}, front-end {body['version']}"})
            return
        self.refused.discard(peer)
        self._new_peer(peer, Peer(body["frontend_id"], time.monotonic(), body.get("pid"), body.get("host")))
        log.info("front-end %s connected (pid %s on %s)", clipped(body["frontend_id"]), body.get("pid"),
                 clipped(body.get("host")))
        self._reply(router, peer, MsgType.WELCOME, {
            "version": PROTOCOL_VERSION, "epoch": self.epoch, "state": (status := self.worker.status).state,
            "model": status.model, "adapter": self.worker.scheduler.adapters.registry.default,
            "started_at": self.started_at, "pid": os.getpid(), "features": [PACKED_TOKEN_IDS, PROMPT_LOGPROBS],
            **({"group": self.worker.group.describe()} if self.worker.group is not None else {})})

    def state(self) -> str:
        """The worker's state, or 'stalled' when one piece of its work runs past --stall-timeout.

        Told apart from dead: the io thread still answers, so front-ends keep their
        streams and /health says what is wrong. A model load is never a stall.
        """
        status = self.worker.status
        if self.worker.group is not None and self.worker.group.failed:
            return "stalled"  # the group failed: alive (for /health) but serving nothing until it restarts
        if self.worker.group is not None and not getattr(self.worker.group, "ready", True):
            return "loading"  # loaded, but rank 0 has not yet checked every rank's weights (`check_weights`)
        if model_store.downloading is not None:
            return "loading"  # a Hub download blocks the mlx thread: slow, but not wedged
        busy_since = status.busy_since
        if (status.state != "loading" and busy_since and self.worker.aux.loading is None
                and time.monotonic() - busy_since > self.stall_timeout):
            return "stalled"
        if self.draining and status.state != "loading":
            return "draining"
        return status.state

    def _on_ping(self, router: zmq.Socket, peer: bytes, body: dict[str, Any]) -> None:
        known = self.peers.get(peer)
        if known is None:
            known = self._new_peer(peer, Peer("", time.monotonic()))
        if "rx" in body:  # bytes it has read from this engine: what it left unread is bounded (`_send`)
            known.rx = body["rx"]
            known.rx_base = known.rx if known.rx_base is None else known.rx_base
        status = self.worker.status
        self._reply(router, peer, MsgType.PONG, {
            "epoch": self.epoch, "state": self.state(), "queued": status.queued,
            "running": status.running, "model": status.model, "t": body.get("t", 0)})

    def _on_add(self, router: zmq.Socket, peer: bytes, body: dict[str, Any]) -> None:
        epoch = body.get("epoch")
        if epoch is not None and epoch != self.epoch:
            self._reply(router, peer, MsgType.ERROR, {
                "rid": body["rid"], "status": 503, "code": "engine_restarted", "type": "server_error",
                "message": "The engine restarted; retry the request"})
            return
        if peer not in self.peers:
            self._new_peer(peer, Peer("", time.monotonic()))
        self.preprocessor.submit(peer, body)  # rendered and tokenized off the mlx thread, then AddCommand

    def _on_abort(self, router: zmq.Socket, peer: bytes, body: dict[str, Any]) -> None:
        self.preprocessor.cancel(peer, body["rids"])  # the sender's own only, as the mlx thread's abort
        self.worker.commands.put(AbortCommand(body["rids"], body.get("reason", "client"), peer))

    def _on_bye(self, router: zmq.Socket, peer: bytes, body: dict[str, Any]) -> None:
        self._peer_gone(peer)

    def _on_call(self, router: zmq.Socket, peer: bytes, body: dict[str, Any]) -> None:
        method, cid, args = body["method"], body["cid"], body.get("args") or {}
        spec = lookup(method)
        if spec is None:
            self._reply(router, peer, MsgType.ERROR, {
                "cid": cid, "status": 400, "code": "unknown_method",
                "type": "invalid_request_error", "message": f"unknown CALL method '{method}'"})
            return
        if spec.thread is Thread.MLX:
            self.worker.commands.put(CallCommand(peer, cid, method, spec.handler, args))
            return
        if spec.thread is Thread.DISK:
            if (refused := self.disk_calls.submit(peer, cid, spec.handler, args)) is not None:
                self._reply(router, peer, MsgType.ERROR, refused)
            return
        if spec.thread is Thread.POOL:
            self.preprocessor.run_call(
                lambda: spec.handler(self.worker.models.current, args,
                                     lambda name: self.worker.scheduler.resolve_model(name, download=False)),
                lambda result, error: self.worker.commands.put(ReplyCommand(peer, cid, result, error)))
            return
        try:
            result = spec.handler(self, args)
        except RequestError as exc:
            self._reply(router, peer, MsgType.ERROR, {**exc.to_body(None), "cid": cid})
            return
        if spec.thread is Thread.AUX:  # checked here; the mlx thread loads its model and runs its job
            self.worker.commands.put(AuxiliaryCommand(peer, cid, result))
            return
        self._reply(router, peer, MsgType.RESULT, {"cid": cid, "result": result})

    # -- peers -------------------------------------------------------------------
    def _peer_gone(self, peer: bytes) -> None:
        self.peers.pop(peer, None)
        self.preprocessor.cancel_peer(peer)
        self.worker.commands.put(PeerGoneCommand(peer))

    def _sweep_peers(self) -> None:
        deadline = time.monotonic() - self.peer_timeout
        for peer in [p for p, info in self.peers.items() if info.last_seen < deadline]:
            log.info("front-end %s silent for %.0f s: aborting its requests",
                     clipped(self.peers[peer].frontend_id) or repr(peer), self.peer_timeout)
            self._peer_gone(peer)
            self._remember_dropped(peer)

    # -- what the io thread knows of the mlx thread -------------------------------------
    def loading(self) -> dict[str, Any]:
        """Which model the mlx thread is loading and for how long (None, None when it is not)."""
        download = model_store.downloading  # one read each: the mlx thread replaces these tuples
        if download is not None:
            return {"loading_model": download[0], "loading_seconds": round(time.monotonic() - download[1], 1),
                    "downloaded_bytes": model_store.downloaded_bytes(download[0])}
        loading = self.worker.models.loading
        if loading is None:
            return {"loading_model": None, "loading_seconds": None}
        return {"loading_model": loading[0], "loading_seconds": round(time.monotonic() - loading[1], 1)}

    def _report_loading(self) -> None:
        """A log line every 10 s of a model load, so a slow load is not mistaken for a hang."""
        loading = self.loading()
        if loading["loading_model"] is None:
            self._load_reported = 0
            return
        if loading["loading_seconds"] >= self._load_reported + 10:
            self._load_reported = int(loading["loading_seconds"]) // 10 * 10
            if "downloaded_bytes" in loading:
                log.info("still downloading model %s (%.0f s, %.0f MiB so far)", loading["loading_model"],
                         loading["loading_seconds"], loading["downloaded_bytes"] / 2**20)
            else:
                log.info("still loading model %s (%.0f s)", loading["loading_model"], loading["loading_seconds"])
