"""Connection limits gunicorn's asyncio ASGI worker lacks: a header deadline, a per-worker cap, quiet logs.

Partial requests (slowloris) were never timed out and connections were not capped: at a
`ulimit -n` of 1024, 200 half-open connections plus idle keep-alives made good clients time
out, and asyncio logged `accept() ... Errno 24` millions of times. This worker class
(`GuardedASGIWorker`, gunicorn's `asgi` worker plus these guards) closes a connection whose
request headers have not all arrived `--header-timeout` seconds after it opened (on a kept-alive
connection gunicorn's keep-alive timer already does this), keeps at most gunicorn's
`worker_connections` (`MLX_FRONTEND_WORKER_CONNECTIONS`, held under the open-file limit, which it
raises to the hard limit) per worker — at the cap a new connection evicts the longest-idle one (or one
whose request body stopped arriving, or trickles under MIN_BODY_RATE, for BODY_STALL_SECONDS), and gets a
503 only when every connection is serving a request — closes a request whose body sends nothing, or
averages under MIN_BODY_RATE, for `--header-timeout` seconds (a slowloris after the headers held its
connection until gunicorn's 120 s worker timeout), and lets each
repeated log message through at most once per `LOG_REPEAT_SECONDS`.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from typing import Any

from gunicorn.asgi.protocol import ASGIProtocol
from gunicorn.workers import gasgi

from http_frontend.gunicorn_settings import DEFAULT_HEADER_TIMEOUT, HEADER_TIMEOUT_ENV

DEFAULT_MAX_CONNECTIONS = 1000
OPEN_FILES_WANTED = 65536  # as the deploy units' LimitNOFILE
# Descriptors the cap leaves free: asyncio accepts up to 100 connections per wake-up before any of them
# reaches `GuardedProtocol.connection_made` (`create_server`'s default backlog), plus the engine
# socket, image fetches and logs.
RESERVED_FILES = 192
MIN_CONNECTIONS = 16
LOG_REPEAT_SECONDS = 10.0
# A request body from which nothing arrived for this long, or that has averaged under MIN_BODY_RATE since its
# headers (after this long), may be evicted at the cap, like an idle connection.
BODY_STALL_SECONDS = 2.0
# Bytes per second a request body must average (a trickle of one byte a second held every slot): checked every
# `--header-timeout` seconds, and at the cap. Any real upload, even over a slow link, is far above it.
MIN_BODY_RATE = 1024.0
_BUSY_BODY = (b'{"error": {"message": "Too many connections", "type": "server_error", "param": null, '
              b'"code": "too_many_conns"}}')
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                 b"connection: close\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class RepeatFilter(logging.Filter):
    """Lets a message through once per `LOG_REPEAT_SECONDS`, then says how many copies it held back."""

    def __init__(self, interval: float = LOG_REPEAT_SECONDS):
        super().__init__()
        self.interval = interval
        self._seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.levelno}:{record.msg}"
        now = time.monotonic()
        last, held = self._seen.get(key, (0.0, 0))
        if now - last < self.interval:
            self._seen[key] = (last, held + 1)
            return False
        if len(self._seen) > 1024:
            self._seen.clear()
        self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like this in the last {self.interval:.0f} s)"
        return True


class GuardedProtocol(ASGIProtocol):
    """gunicorn's ASGI protocol with a header deadline and a connection cap.

    At the cap a new connection evicts the one idle longest — waiting for its request's headers
    (half-open, slowloris) or kept alive between requests — so connections that send nothing can
    never lock a good client out; only when every connection is serving a request does the newcomer
    get the 503. `idle` (oldest first) and `live` are the worker's own (`GuardedASGIWorker`).
    """

    header_timeout = DEFAULT_HEADER_TIMEOUT
    max_connections = DEFAULT_MAX_CONNECTIONS

    def connection_made(self, transport: Any) -> None:
        self._header_handle = None
        super().connection_made(transport)
        if self._closed:
            return
        idle, live = _tables(self.worker)
        live.add(self)
        if len(live) > self.max_connections:
            victim = next((other for other in idle if other is not self), None) or self._stalled_body()
            if victim is None:
                transport.write(BUSY_RESPONSE)
                self._drop()
                return
            victim._drop()
        idle[self] = None  # waiting for its first request
        self._arm_header_deadline()

    def _stalled_body(self) -> GuardedProtocol | None:
        """A connection whose request body has been silent, or trickling, for over BODY_STALL_SECONDS."""
        now = time.monotonic()
        for other in _reading(self.worker):  # silent longest first
            if other is not self and other._body_too_slow(now, BODY_STALL_SECONDS):
                return other
        return None

    def _body_too_slow(self, now: float, grace: float) -> bool:
        """Silent for `grace` seconds, or under MIN_BODY_RATE on average once `grace` has passed."""
        started, last = getattr(self, "_body_started", now), _reading(self.worker).get(self, now)
        if now - last > grace:
            return True
        elapsed = now - started
        return elapsed > grace and self._body_bytes / elapsed < MIN_BODY_RATE

    def _drop(self) -> None:
        """Close from our side; the connection loop (if it waits for a request) sees it and exits."""
        self._close_transport()
        if self._request_ready is not None:
            self._request_ready.set()

    def _close_transport(self) -> None:
        self._forget()
        super()._close_transport()

    def _forget(self) -> None:
        """Out of every table, timers off: the connection is closing."""
        for name in ("_header_handle", "_body_handle"):
            if getattr(self, name, None) is not None:
                getattr(self, name).cancel()
                setattr(self, name, None)
        idle, live = _tables(self.worker)
        idle.pop(self, None)
        live.discard(self)
        _reading(self.worker).pop(self, None)

    def _arm_header_deadline(self) -> None:
        if getattr(self, "_header_handle", None) is not None:
            self._header_handle.cancel()
        self._header_handle = None
        if not self._closed and self.header_timeout > 0:
            self._header_handle = self.worker.loop.call_later(self.header_timeout, self._header_deadline)

    def _header_deadline(self) -> None:
        self._header_handle = None
        self._drop()

    def _on_headers_complete(self) -> Any:
        if self._header_handle is not None:
            self._header_handle.cancel()
            self._header_handle = None
        _tables(self.worker)[0].pop(self, None)  # serving a request: evicted only while its body stalls
        result = super()._on_headers_complete()
        self._body_started, self._body_bytes = time.monotonic(), 0
        self._body_progress()
        if getattr(self, "_body_handle", None) is not None:
            self._body_handle.cancel()
        self._body_handle = None
        if self.header_timeout > 0 and not self._closed and self in _reading(self.worker):
            self._body_handle = self.worker.loop.call_later(self.header_timeout, self._body_deadline)
        return result

    def _on_body(self, chunk: Any) -> Any:
        result = super()._on_body(chunk)
        self._body_bytes = getattr(self, "_body_bytes", 0) + len(chunk)
        self._body_progress()
        return result

    def _on_message_complete(self) -> Any:
        """The whole request arrived: no body deadline, never evicted while the app answers it."""
        _reading(self.worker).pop(self, None)
        if getattr(self, "_body_handle", None) is not None:
            self._body_handle.cancel()
            self._body_handle = None
        return super()._on_message_complete()

    def _body_progress(self) -> None:
        """Its body is still coming: now the newest in the reading table (silent longest first)."""
        if self._closed:
            return
        reading = _reading(self.worker)
        reading.pop(self, None)
        reading[self] = time.monotonic()

    def _body_deadline(self) -> None:
        """Every `header_timeout` seconds while the body arrives: closed when silent that long or trickling.

        A body silent for `header_timeout` seconds, or averaging under MIN_BODY_RATE, is a slowloris after
        the headers (it held its connection until gunicorn's 120 s worker timeout).
        """
        self._body_handle = None
        if self._closed or self not in _reading(self.worker):
            return
        if self._body_too_slow(time.monotonic(), self.header_timeout):
            self._drop()
        else:
            self._body_handle = self.worker.loop.call_later(self.header_timeout, self._body_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)


def _tables(worker: Any) -> tuple[dict[GuardedProtocol, None], set[GuardedProtocol]]:
    """The worker's idle connections (oldest first) and its open ones (`GuardedASGIWorker` makes them)."""
    if not hasattr(worker, "idle_connections"):
        worker.idle_connections, worker.live_connections = {}, set()
    return worker.idle_connections, worker.live_connections


def _reading(worker: Any) -> dict[GuardedProtocol, float]:
    """Connections whose request body is still arriving -> when its last bytes came (silent longest first)."""
    if not hasattr(worker, "reading_connections"):
        worker.reading_connections = {}
    return worker.reading_connections


def raise_open_file_limit(log: Any) -> int:
    """Raise this process's soft open-file limit to its hard limit (systemd's default soft limit is 1024)
    and return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = [hard] if hard != resource.RLIM_INFINITY else [OPEN_FILES_WANTED, 10240]  # 10240: macOS' OPEN_MAX
    for limit in wanted:
        if limit <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            return limit
        except (ValueError, OSError):
            continue
    if soft < OPEN_FILES_WANTED:
        log.info("open-file limit %d (raise it with LimitNOFILE / ulimit -n)", soft)
    return soft


class GuardedASGIWorker(gasgi.ASGIWorker):
    """gunicorn's `asgi` worker serving `GuardedProtocol` connections, with repeated log lines held back."""

    def init_process(self) -> None:
        GuardedProtocol.header_timeout = float(os.environ.get(HEADER_TIMEOUT_ENV) or DEFAULT_HEADER_TIMEOUT)
        cap = self.cfg.worker_connections or DEFAULT_MAX_CONNECTIONS
        # Past the open-file limit accept() fails (EMFILE) and nobody is served: the cap stays under it.
        room = max(raise_open_file_limit(self.log) - RESERVED_FILES, MIN_CONNECTIONS)
        if cap > room:
            self.log.warning("worker connections capped at %d (not %d): the open-file limit is too low", room, cap)
            cap = room
        GuardedProtocol.max_connections = cap
        _tables(self)
        # The worker builds its connections with the name `ASGIProtocol` of its own module.
        gasgi.ASGIProtocol = GuardedProtocol
        flood = RepeatFilter()
        for name in ("asyncio", "gunicorn.error"):
            logging.getLogger(name).addFilter(flood)
        super().init_process()
