"""Sees every HTTP request from arrival to last byte: HTTP metrics and the access line.

An ASGI wrapper around the falcon app, outside every falcon middleware, so a
request refused before routing (a 401, a 413, an unknown path) is counted and
logged like any other, and a stream's duration runs to its last byte. The access
line carries the engine's request id (`RID_KEY`, set by `serve_generation`), the
same rid the engine logs, so one request is followed across both processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import falcon

from http_frontend.middleware.asgi import HttpWrapper, Receive, Send
from http_frontend.service.metrics import RID_KEY, START_KEY, FrontendMetrics

access_log = logging.getLogger("http_frontend.access")

KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class RequestObserver(HttpWrapper):
    """Counts every request and writes its access line once the last byte is handed over.

    An ASGI wrapper rather than falcon middleware: falcon's response hooks run before
    a stream's body, and a stream's duration is what matters. `route_of(path)` maps a
    path to its route template (bounded label values); unknown paths count as "other".
    """

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: FrontendMetrics,
                 route_of: Callable[[str], str | None]):
        super().__init__(app)
        self.metrics = metrics
        self.route_of = route_of

    async def handle(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        scope[START_KEY] = started
        status = 0
        recorded = False

        def record(outcome: str) -> None:
            nonlocal recorded
            if recorded:
                return
            recorded = True
            seconds = time.perf_counter() - started
            route = self.route_of(scope.get("path", "")) or "other"
            method = scope.get("method", "")
            if method not in KNOWN_METHODS:
                method = "other"  # label values stay a bounded set
            self.metrics.record_request(route, method, status or 500, seconds)
            client = scope.get("client") or ("-", 0)
            access_log.info("rid=%s method=%s route=%s path=%s status=%d duration_ms=%.1f client=%s outcome=%s",
                            scope.get(RID_KEY) or "-", _printable(method), route,
                            _printable(scope.get("path", "")), status or 500, seconds * 1000, client[0], outcome)

        async def observed_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record("complete")  # before the last byte leaves: a client's next scrape sees it
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            record("disconnected" if status else "failed")


def _printable(text: str, limit: int = 200) -> str:
    """A client-chosen string made safe for one log line (a %0A in a path cannot forge a line)."""
    text = text[:limit]
    return text if text.isprintable() and " " not in text else text.encode("unicode_escape").decode(
        "ascii").replace(" ", "\\x20")


def route_finder(router: Any) -> Callable[[str], str | None]:
    """Route template of a path through falcon's router (public `find`), None when unknown."""
    def route_of(path: str) -> str | None:
        try:
            found = router.find(path)
        except falcon.HTTPError:
            return None
        return found[3] if found else None
    return route_of
