"""Connection limits gunicorn's asyncio ASGI worker lacks: a header deadline, a per-worker cap, quiet logs.

Partial requests (slowloris) were never timed out and connections were not capped: at a
`ulimit -n` of 1024, 200 half-open connections plus idle keep-alives made good clients time
out, and asyncio logged `accept() ... Errno 24` millions of times. This worker class
(`GuardedASGIWorker`, gunicorn's `asgi` worker plus these guards) closes a connection whose
request headers have not all arrived `--header-timeout` seconds after it opened (on a kept-alive
connection gunicorn's keep-alive timer already does this), refuses connections past gunicorn's
`worker_connections` (`MLX_FRONTEND_WORKER_CONNECTIONS`) per worker with a 503, and
lets each repeated log message through at most once per `LOG_REPEAT_SECONDS`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from gunicorn.asgi.protocol import ASGIProtocol
from gunicorn.workers import gasgi

from http_frontend.gunicorn_settings import DEFAULT_HEADER_TIMEOUT, HEADER_TIMEOUT_ENV

DEFAULT_MAX_CONNECTIONS = 1000
LOG_REPEAT_SECONDS = 10.0
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                 b"connection: close\r\ncontent-length: 96\r\n\r\n"
                 b'{"error": {"message": "Too many connections", "type": "server_error", "code": "too_many_conns"}}')


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
    """gunicorn's ASGI protocol with a header deadline and a connection cap."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    max_connections = DEFAULT_MAX_CONNECTIONS

    def connection_made(self, transport: Any) -> None:
        self._header_handle = None
        super().connection_made(transport)
        if self.worker.nr_conns > self.max_connections:
            transport.write(BUSY_RESPONSE)
            self._close_transport()
            return
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        if getattr(self, "_header_handle", None) is not None:
            self._header_handle.cancel()
        self._header_handle = None
        if not self._closed and self.header_timeout > 0:
            self._header_handle = self.worker.loop.call_later(self.header_timeout, self._header_deadline)

    def _header_deadline(self) -> None:
        self._header_handle = None
        self._close_transport()
        if self._request_ready is not None:
            self._request_ready.set()  # the connection loop sees the close and exits

    def _on_headers_complete(self) -> Any:
        if self._header_handle is not None:
            self._header_handle.cancel()
            self._header_handle = None
        return super()._on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_header_handle", None) is not None:
            self._header_handle.cancel()
            self._header_handle = None
        super().connection_lost(exc)


class GuardedASGIWorker(gasgi.ASGIWorker):
    """gunicorn's `asgi` worker serving `GuardedProtocol` connections, with repeated log lines held back."""

    def init_process(self) -> None:
        GuardedProtocol.header_timeout = float(os.environ.get(HEADER_TIMEOUT_ENV) or DEFAULT_HEADER_TIMEOUT)
        GuardedProtocol.max_connections = self.cfg.worker_connections or DEFAULT_MAX_CONNECTIONS
        # The worker builds its connections with the name `ASGIProtocol` of its own module.
        gasgi.ASGIProtocol = GuardedProtocol
        flood = RepeatFilter()
        for name in ("asyncio", "gunicorn.error"):
            logging.getLogger(name).addFilter(flood)
        super().init_process()
