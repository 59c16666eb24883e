"""GET /admin/engines and POST /admin/engines/{id}/drain | undrain: the engines behind this front-end.

Draining is for rolling restarts and model upgrades: the engine stops getting new
requests from every front-end worker (it says `draining` in its PONGs), its open
streams finish, and once /admin/engines shows it idle it can be stopped. Draining
and undraining change what every client shares, so they need the admin role.
"""

from __future__ import annotations

from typing import Any

import falcon.asgi

from http_frontend.engine.calls import call_engine
from http_frontend.engine.pool import EnginePool
from http_frontend.errors import APIError
from protocol import CallMethod


def engine_view(pool: EnginePool, engine_id: str) -> dict[str, Any]:
    """One engine as this worker sees it: where, its state, and the load the router counts."""
    link = pool.links[engine_id]
    return {"id": engine_id, "endpoint": getattr(link, "endpoint", None), "state": pool.state_of(engine_id),
            "routable": pool.routable(engine_id), "model": getattr(link, "model", None),
            "queued": getattr(link, "queued", 0), "running": getattr(link, "running", 0),
            "load": getattr(link, "load", 0), "open_streams": len(link.streams)}


class Engines:
    """GET /admin/engines: every engine with its state and load, as this worker routes."""

    def __init__(self, pool: EnginePool):
        self.pool = pool

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        # `frontend`: whose view this is (each worker routes by its own, e.g. one started after an engine died)
        resp.media = {"object": "list", "frontend": self.pool.frontend_id,
                      "data": [engine_view(self.pool, engine_id) for engine_id in self.pool.ids]}


class EngineDrain:
    """POST /admin/engines/{engine_id}/drain and …/undrain."""

    admin_methods = frozenset({"POST"})

    def __init__(self, pool: EnginePool):
        self.pool = pool

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, engine_id: str) -> None:
        await self._set(resp, engine_id, True)

    async def on_post_undrain(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, engine_id: str) -> None:
        await self._set(resp, engine_id, False)

    async def _set(self, resp: falcon.asgi.Response, engine_id: str, draining: bool) -> None:
        if engine_id not in self.pool.links:
            raise APIError(404, f"No engine '{engine_id}' behind this front-end (see GET /admin/engines)",
                           code="engine_not_found", param="engine_id")
        await call_engine(self.pool, CallMethod.DRAIN, args={"draining": draining}, engine=engine_id)
        self.pool.mark_drained(engine_id, draining)
        resp.media = engine_view(self.pool, engine_id)
