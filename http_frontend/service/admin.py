"""POST /unload and GET /stats: operator routes, each one CALL to the engine.

The catalogue is `service.models`, liveness `service.health`, the adapter registry
`service.adapters`; what is left here changes or reports the engine as a whole.
"""

from __future__ import annotations

from typing import Any

import falcon.asgi

from http_frontend.engine.calls import call_engine
from http_frontend.engine.client import EngineClient
from protocol import CallMethod


class Unload:
    """Unloads the engine's model (running requests end with 503 `model_unloaded`); the next request loads one."""

    admin_methods = frozenset({"POST"})  # it ends every client's streams: the admin role's (`needs_admin`)

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = await call_engine(self.client, CallMethod.UNLOAD, timeout=60.0)


class Stats:
    """The engine's figures (`CALL stats`) plus this worker's id and its open engine requests."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        stats: dict[str, Any] = await call_engine(self.client, CallMethod.STATS)
        stats["frontend"] = {"id": self.client.frontend_id, "open_streams": len(self.client.streams)}
        resp.media = stats
