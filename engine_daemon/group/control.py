"""Wake-ups and heartbeats between rank 0 and its followers, over one ZeroMQ socket pair.

Why not a collective: an idle follower blocked in a ring collective busy-polls (mlx_lm.server's
idle loop burned ~0.3 core). Followers instead block on a `threading.Event` that this
socket's thread sets when rank 0 sends WAKE, just before its next plan.

Heartbeats (every HEARTBEAT s both ways) name the rank that is gone when a collective
fails or the watchdog fires, and let a follower whose rank 0 vanished exit so the group
restarts. The socket is plain TCP on the group's private link, like the ring backend
itself (no authentication: see deploy/groups.md).

Messages, one frame each. Follower → rank 0: `HB <rank> <weights bytes> <active bytes> <pid>
<weights digest, "-" until loaded> <tick> <in step 0|1>`; rank 0 reads the fields it knows and
ignores any a newer engine appends. Engines before the weights check sent only the first three
or four fields: rank 0 tells that "field absent" (an older engine: `older`) from "-" (not loaded
yet). Rank 0 → follower: `ACK`, `WAKE`, and `REFUSE <why>` when rank 0 refuses the group at
start (`ControlServer.refuse`): the follower logs why and exits at once, from this thread, so it
never waits on a collective rank 0 will not join. Older followers read any answer as an ACK.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from engine_daemon.group.settings import GROUP_FAILED_EXIT

log = logging.getLogger(__name__)

HEARTBEAT = 0.5
LOST_AFTER = 5.0  # seconds without a heartbeat: the peer is gone (slack for a busy, GIL-bound rank)
WAKE_ADDRESS = "inproc://group-wake"
REFUSE = b"REFUSE "
DIGEST_FIELD = 5  # heartbeats with fewer fields come from an engine older than the weights check


class ControlServer(threading.Thread):
    """Rank 0's side: registers followers, answers heartbeats, sends WAKE on request."""

    def __init__(self, context: zmq.Context, endpoint: str, size: int):
        super().__init__(name="group-control", daemon=True)
        self.context, self.endpoint, self.size = context, endpoint, size
        self.last_seen: dict[int, float] = {}
        # rank -> its weights and active memory, its weights digest (heartbeats)
        self.reports: dict[int, dict[str, Any]] = {}
        self.progress: dict[int, tuple[int, bool]] = {}  # rank -> (tick it took last, inside that tick's step)
        self.older: dict[int, int] = {}  # rank -> fields in its heartbeats, when it sends no digest field at all
        self._refusal: bytes | None = None  # REFUSE + why, once rank 0 refused the group (`refuse`)
        self._refusal_sent = threading.Event()
        self._identities: dict[int, bytes] = {}
        self._registered = threading.Event()
        self._halt = threading.Event()
        self.on_lost = None  # callable(rank | None): set by the owner; None: a connection closed, rank unknown
        self.on_older: Callable[[int, int], None] | None = None  # (rank, fields): an older engine's first heartbeat
        self.stopping = False  # a clean shutdown: followers leaving is expected
        self._lost: set[int] = set()
        self._waker = context.socket(zmq.PUSH)  # used by the mlx thread only (`wake`)
        self._wake_in = context.socket(zmq.PULL)
        self._wake_in.bind(WAKE_ADDRESS)
        self._waker.connect(WAKE_ADDRESS)
        self.wakes = 0

    def wait_for_followers(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    def wake(self) -> None:
        """Called on the mlx thread: every follower leaves its idle wait (a plan follows)."""
        self._waker.send(b"W")

    def stale_ranks(self, older_than: float = LOST_AFTER) -> list[int]:
        now = time.monotonic()
        return [rank for rank in range(1, self.size) if now - self.last_seen.get(rank, 0.0) > older_than]

    def refuse(self, reason: str, wait: float = 1.0) -> bool:
        """Any thread: every follower is told rank 0 refused the group, and why (now, and in answer to any
        later heartbeat; the first verdict stands). Waits up to `wait` s for the control thread to send it;
        True once sent."""
        if self._refusal is None:
            self._refusal = REFUSE + reason.encode(errors="replace")
        return self._refusal_sent.wait(wait)

    def flush_refusal(self, timeout: float = 1.0) -> None:
        """Before the process exits: a refusal the control thread is about to send gets out (sent, then ~0.1 s
        for ZeroMQ's I/O thread to write it; `os._exit` would drop a queued frame)."""
        if self._refusal is not None and self._refusal_sent.wait(timeout):
            time.sleep(0.1)

    def stop(self) -> None:
        """Ends the thread and closes every socket (the engine's context.term() waits for them)."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=2.0)
        self._waker.close(linger=0)

    def run(self) -> None:
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(self.endpoint)
        # A killed follower's TCP connection closes at once (the ring backend may not raise for a long time):
        # the disconnect fails the group within milliseconds, the heartbeats then say which rank it was.
        monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._halt.is_set():
                if self._refusal is not None and not self._refusal_sent.is_set():
                    for identity in self._identities.values():
                        self._send(router, identity, self._refusal)
                    log.info("group: told the followers (ranks %s) rank 0 refuses the group", sorted(self._identities))
                    self._refusal_sent.set()
                ready = dict(poller.poll(100))
                if self._wake_in in ready:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                    self.wakes += 1
                    for identity in self._identities.values():
                        self._send(router, identity, b"WAKE")
                if router in ready:
                    while router.poll(0):
                        identity, message = router.recv_multipart()
                        self._heard(router, identity, message)
                if monitor in ready:
                    while monitor.poll(0):
                        monitor.recv_multipart()
                        if self._registered.is_set() and not self._expected_exits() and self.on_lost is not None:
                            log.warning("group: a follower's control connection closed")
                            self.on_lost(None)
                self._check_lost()
        finally:
            try:
                router.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)
            router.close(linger=0)
            self._wake_in.close(linger=0)

    def _send(self, router: zmq.Socket, identity: bytes, message: bytes) -> None:
        try:
            router.send_multipart([identity, message], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("group control: cannot reach %r: %s", identity, exc)

    def _heard(self, router: zmq.Socket, identity: bytes, message: bytes) -> None:
        if not message.startswith(b"HB "):
            return
        parts = message[3:].decode(errors="replace").split()
        try:  # an engine before the weights check sent 3 or 4 integers (no pid before 273d314)
            rank, weights, active = (int(part) for part in parts[:3])
            pid = int(parts[3]) if len(parts) > 3 else None
        except ValueError:
            return
        if not 0 < rank < self.size:
            return
        if rank not in self._identities:
            log.info("group: rank %d joined the control socket", rank)
        self._identities[rank] = identity
        self.last_seen[rank] = time.monotonic()
        report: dict[str, Any] = {"weights_bytes": weights, "active_bytes": active, "pid": pid}
        if len(parts) < DIGEST_FIELD:  # no digest field at all: not "not loaded yet" ("-"), an older engine
            first = rank not in self.older
            self.older[rank] = len(parts)
            report["older_engine"] = True
            if first:
                log.warning("group: rank %d's heartbeats have %d fields, no weights digest: an older engine",
                            rank, len(parts))
                if self.on_older is not None:
                    self.on_older(rank, len(parts))  # refuses (`refuse`, no wait: this is the thread that sends)
        elif parts[4] != "-":  # its checkpoint's `weights_digest`, once its model loaded
            report["weights_digest"] = parts[4][:64]
        self.reports[rank] = report
        if len(parts) > 6:  # the last plan's tick its mlx thread took, and whether it is still applying it
            try:
                self.progress[rank] = (int(parts[5]), parts[6] == "1")
            except ValueError:
                pass
        if len(self._identities) == self.size - 1:
            self._registered.set()
        self._send(router, identity, self._refusal if self._refusal_sent.is_set() else b"ACK")

    def _expected_exits(self) -> bool:
        """A clean stop, or a refusal at start: followers leaving is what rank 0 asked for, not a fault."""
        return self.stopping or self._refusal is not None

    def _check_lost(self) -> None:
        if not self._registered.is_set() or self.on_lost is None or self._expected_exits():
            return
        for rank in self.stale_ranks():
            if rank not in self._lost:
                self._lost.add(rank)
                self.on_lost(rank)


class ControlClient(threading.Thread):
    """A follower's side: heartbeats to rank 0, WAKE sets `woken`; no rank 0 for long: exit 75."""

    def __init__(self, context: zmq.Context, endpoint: str, rank: int, memory: Callable[[], tuple[int, int]],
                 lost_after: float = LOST_AFTER * 2, digest: Callable[[], str] = lambda: "",
                 progress: Callable[[], tuple[int, bool]] = lambda: (-1, False), older_fields: int = 0):
        super().__init__(name="group-control", daemon=True)
        self.context, self.endpoint, self.rank = context, endpoint, rank
        self.woken = threading.Event()
        self.memory = memory  # (weights bytes, active bytes) reported with every heartbeat
        self.digest = digest  # the loaded checkpoint's weights digest ("" until it loaded): rank 0 compares it
        self.progress = progress  # (the last plan's tick, inside it): rank 0's watchdog tells slow from hung
        self.lost_after = lost_after
        self.older_fields = older_fields  # tests only (3 or 4): heartbeats as an engine before the weights check
        self._halt = threading.Event()
        self.last_ack = 0.0

    def stop(self) -> None:
        self._halt.set()

    def wait_wake(self, stopping: threading.Event) -> bool:
        """Blocks (no spinning) until rank 0 wakes this rank; False when stopping."""
        while not stopping.is_set():
            if self.woken.wait(1.0):
                self.woken.clear()
                return True
        return False

    def run(self) -> None:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint)
        started = time.monotonic()
        next_beat = 0.0
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    dealer.send(self._heartbeat())
                    next_beat = now + HEARTBEAT
                if dealer.poll(int(HEARTBEAT * 1000)):
                    message = dealer.recv()
                    if message == b"WAKE":
                        self.woken.set()
                    elif message.startswith(REFUSE):
                        self._refused(message[len(REFUSE):].decode(errors="replace"))
                    self.last_ack = time.monotonic()
                # Before the first answer rank 0 may still be starting: give it a minute.
                limit = self.lost_after if self.last_ack else 60.0
                if time.monotonic() - (self.last_ack or started) > limit:
                    log.critical("group: rank 0 silent for %.0f s: this rank (%d) exits so the group restarts",
                                 limit, self.rank)
                    logging.shutdown()
                    os._exit(GROUP_FAILED_EXIT)
        finally:
            dealer.close()

    def _heartbeat(self) -> bytes:
        tick, busy = self.progress()
        fields = b"%d %d %d %d %s %d %d" % (self.rank, *self.memory(), os.getpid(), (self.digest() or "-").encode(),
                                            tick, busy)
        if self.older_fields:
            fields = b" ".join(fields.split()[:self.older_fields])
        return b"HB " + fields

    def _refused(self, reason: str) -> None:
        """Rank 0 will never send a plan: exit now, from this thread, whatever the main thread waits on (a
        collective of the load, or the idle wait); the launcher or unit sees a failed rank."""
        log.error("group: rank 0 refused the group at start: %s; this rank (%d) exits %d now", reason, self.rank,
                  GROUP_FAILED_EXIT)
        logging.shutdown()
        os._exit(GROUP_FAILED_EXIT)
