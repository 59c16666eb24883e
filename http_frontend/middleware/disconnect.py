"""Notices a client that hangs up, for streaming and non-streaming requests alike.

ASGI reports a gone client only to whoever calls `receive()`. Falcon reads the body
through it and, for SSE responses, watches for the disconnect only between two
events. This wrapper owns `receive()`: once the body is read it keeps listening,
and exposes an asyncio.Event in `scope["mlx_engined.disconnected"]` so a handler
waiting on the engine (a non-streamed completion) can abort at once. A body that fails
half-way (`ResponseCut`) ends the connection without its last chunk.
"""

from __future__ import annotations

import asyncio
from typing import Any

from http_frontend.errors import ResponseCut
from http_frontend.middleware.asgi import HttpWrapper, Receive, Send

SCOPE_KEY = "mlx_engined.disconnected"


class DisconnectWatch(HttpWrapper):
    async def handle(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        disconnected = asyncio.Event()
        scope[SCOPE_KEY] = disconnected
        watcher: asyncio.Task | None = None
        body_done = False

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return

        async def wrapped_receive() -> dict[str, Any]:
            nonlocal body_done, watcher
            if body_done:
                await disconnected.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
            elif not message.get("more_body", False):
                body_done = True
                watcher = asyncio.create_task(watch())
            return message

        try:
            await self.app(scope, wrapped_receive, send)
        except ResponseCut:
            # gunicorn closes the connection mid-body on a cancellation, quietly (any other exception
            # is logged as an application error with its traceback): the reason was logged already.
            raise asyncio.CancelledError() from None
        finally:
            if watcher is not None:
                watcher.cancel()


def disconnected_event(scope: dict[str, Any]) -> asyncio.Event:
    """The request's disconnect event (a never-set one outside DisconnectWatch)."""
    return scope.get(SCOPE_KEY) or asyncio.Event()
