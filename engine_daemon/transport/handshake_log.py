"""Failed CURVE handshakes on the engine's ROUTER, logged: a front-end with a wrong key is otherwise silent.

ZeroMQ drops such a connection without a word to the application (the ZAP handler logs its
denials at DEBUG only), so an operator saw front-ends that never connected and nothing in either
log. The io thread polls this monitor beside the ROUTER (`EngineServer.serve`) and logs each kind of
failure at most once per `QUIET_SECONDS` (front-ends retry every second), with the count folded in.
`QuietLog`, that rate limit, also keeps one peer's bad frames from flooding the log (`EngineServer._receive`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Hashable

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


class QuietLog:
    """At most one log line per key per `quiet` seconds, the lines held back counted into the next one.

    Keys are bounded (`max_keys`, the oldest forgotten): a peer cycling identities cannot grow it.
    """

    def __init__(self, quiet: float = QUIET_SECONDS, max_keys: int = 4096):
        self.quiet = quiet
        self.max_keys = max_keys
        self._last: collections.OrderedDict[Hashable, float] = collections.OrderedDict()
        self._folded: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> int | None:
        """None: stay quiet about `key`; else log now, with this many lines held back since the last one."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.quiet:
            self._folded[key] = self._folded.get(key, 0) + 1
            return None
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            forgotten, _ = self._last.popitem(last=False)
            self._folded.pop(forgotten, None)
        return self._folded.pop(key, 0)


def folded(more: int) -> str:
    return f" ({more} more since the last line)" if more else ""


class HandshakeLog:
    """The ROUTER's monitor socket (poll `monitor`, then call `drain`)."""

    def __init__(self, router: zmq.Socket):
        events = 0
        for event in FAILURES:
            events |= event
        self.router = router
        self.monitor = router.get_monitor_socket(events)
        self._quiet = QuietLog()

    def drain(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event not in FAILURES:
                continue
            more = self._quiet.allow(event)
            if more is not None:
                log.warning("CURVE handshake %s%s", FAILURES[event], folded(more))

    def close(self) -> None:
        self.router.disable_monitor()
        self.monitor.close(0)
