"""Wake-ups and heartbeats between rank 0 and its followers, over one ZeroMQ socket pair.

Why not a collective: an idle follower blocked in a ring collective busy-polls (mlx_lm.server's
idle loop burned ~0.3 core). Followers instead block on a `threading.Event` that this
socket's thread sets when rank 0 sends WAKE, just before its next plan.

Heartbeats (every HEARTBEAT s both ways) name the rank that is gone when a collective
fails or the watchdog fires, and let a follower whose rank 0 vanished exit so the group
restarts. The socket is plain TCP on the group's private link, like the ring backend
itself (no authentication: see deploy/groups.md).
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


class ControlServer(threading.Thread):
    """Rank 0's side: registers followers, answers heartbeats, sends WAKE on request."""

    def __init__(self, context: zmq.Context, endpoint: str, size: int):
        super().__init__(name="group-control", daemon=True)
        self.context, self.endpoint, self.size = context, endpoint, size
        self.last_seen: dict[int, float] = {}
        # rank -> its weights and active memory, its weights digest (heartbeats)
        self.reports: dict[int, dict[str, Any]] = {}
        self.progress: dict[int, tuple[int, bool]] = {}  # rank -> (tick it took last, inside that tick's step)
        self._identities: dict[int, bytes] = {}
        self._registered = threading.Event()
        self._halt = threading.Event()
        self.on_lost = None  # callable(rank | None): set by the owner; None: a connection closed, rank unknown
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
                        if self._registered.is_set() and not self.stopping and self.on_lost is not None:
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
        try:
            rank, weights, active, pid = (int(part) for part in parts[:4])
        except ValueError:
            return
        if not 0 < rank < self.size:
            return
        if rank not in self._identities:
            log.info("group: rank %d joined the control socket", rank)
        self._identities[rank] = identity
        self.last_seen[rank] = time.monotonic()
        report: dict[str, Any] = {"weights_bytes": weights, "active_bytes": active, "pid": pid}
        if len(parts) > 4 and parts[4] != "-":  # its checkpoint's `weights_digest`, once its model loaded
            report["weights_digest"] = parts[4][:64]
        self.reports[rank] = report
        if len(parts) > 6:  # the last plan's tick its mlx thread took, and whether it is still applying it
            try:
                self.progress[rank] = (int(parts[5]), parts[6] == "1")
            except ValueError:
                pass
        if len(self._identities) == self.size - 1:
            self._registered.set()
        self._send(router, identity, b"ACK")

    def _check_lost(self) -> None:
        if not self._registered.is_set() or self.on_lost is None or self.stopping:
            return
        for rank in self.stale_ranks():
            if rank not in self._lost:
                self._lost.add(rank)
                self.on_lost(rank)


class ControlClient(threading.Thread):
    """A follower's side: heartbeats to rank 0, WAKE sets `woken`; no rank 0 for long: exit 75."""

    def __init__(self, context: zmq.Context, endpoint: str, rank: int, memory: Callable[[], tuple[int, int]],
                 lost_after: float = LOST_AFTER * 2, digest: Callable[[], str] = lambda: "",
                 progress: Callable[[], tuple[int, bool]] = lambda: (-1, False)):
        super().__init__(name="group-control", daemon=True)
        self.context, self.endpoint, self.rank = context, endpoint, rank
        self.woken = threading.Event()
        self.memory = memory  # (weights bytes, active bytes) reported with every heartbeat
        self.digest = digest  # the loaded checkpoint's weights digest ("" until it loaded): rank 0 compares it
        self.progress = progress  # (the last plan's tick, inside it): rank 0's watchdog tells slow from hung
        self.lost_after = lost_after
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
                    tick, busy = self.progress()
                    dealer.send(b"HB %d %d %d %d %s %d %d" % (self.rank, *self.memory(), os.getpid(),
                                                                (self.digest() or "-").encode(), tick, busy))
                    next_beat = now + HEARTBEAT
                if dealer.poll(int(HEARTBEAT * 1000)):
                    message = dealer.recv()
                    if message == b"WAKE":
                        self.woken.set()
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
