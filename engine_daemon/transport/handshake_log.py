"""Failed CURVE handshakes on the engine's ROUTER, logged: a front-end with a wrong key is otherwise silent.

ZeroMQ drops such a connection without a word to the application (the ZAP handler logs its
denials at DEBUG only), so an operator saw front-ends that never connected and nothing in either
log. The io thread polls this monitor beside the ROUTER (`EngineServer.serve`) and logs each kind of
failure at most once per `QUIET_SECONDS` (front-ends retry every second), with the count folded in.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

QUIET_SECONDS = 30.0
FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed: a peer without CURVE, or with another server key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed on a protocol error: a peer without CURVE, or with another "
                                         "server key",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "was refused: a front-end key not in --curve-authorized-keys",
}


class HandshakeLog:
    """The ROUTER's monitor socket (poll `monitor`, then call `drain`)."""

    def __init__(self, router: zmq.Socket):
        events = 0
        for event in FAILURES:
            events |= event
        self.router = router
        self.monitor = router.get_monitor_socket(events)
        self._last: dict[int, float] = {}
        self._folded: dict[int, int] = {}

    def drain(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event not in FAILURES:
                continue
            now = time.monotonic()
            if now - self._last.get(event, -QUIET_SECONDS) < QUIET_SECONDS:
                self._folded[event] = self._folded.get(event, 0) + 1
                continue
            more = self._folded.pop(event, 0)
            self._last[event] = now
            log.warning("CURVE handshake %s%s", FAILURES[event], f" ({more} more since the last line)" if more else "")

    def close(self) -> None:
        self.router.disable_monitor()
        self.monitor.close(0)
