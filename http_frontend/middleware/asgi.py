"""A base for the ASGI wrappers around the falcon app (disconnect watch, request metrics)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


class HttpWrapper:
    """Wraps an ASGI app: HTTP requests go through `handle`, everything else (lifespan) straight on.

    Attribute access falls through to the wrapped app, so callers can still use
    falcon's add_route, add_error_handler, ... on the outermost object.
    """

    def __init__(self, app: App):
        self.app = app

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        raise NotImplementedError
