"""POST /unload and GET /stats: operator routes, each one CALL to the engine.

The catalogue is `service.models`, liveness `service.health`, the adapter registry
`service.adapters`; what is left here changes or reports the engine as a whole.
"""

from __future__ import annotations

from typing import Any

import falcon.asgi

from http_frontend.engine.calls import call_engine
from http_frontend.engine.pool import EnginePool
from http_frontend.errors import APIError
from protocol import CallMethod


class Unload:
    """Unloads the engine's model (running requests end with 503 `model_unloaded`); the next request loads one.

    Behind several engines: `?engine=ID` unloads that one, else every engine in turn.
    """

    admin_methods = frozenset({"POST"})  # it ends every client's streams: the admin role's (`needs_admin`)

    def __init__(self, client: EnginePool):
        self.client = client

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not isinstance(self.client, EnginePool) or self.client.single:
            resp.media = await call_engine(self.client, CallMethod.UNLOAD, timeout=60.0)
            return
        engine = req.get_param("engine")
        targets = [engine] if engine else self.client.ids
        if engine:
            resp.media = await call_engine(self.client, CallMethod.UNLOAD, timeout=60.0, engine=engine)
            return
        results: dict[str, Any] = {}
        for target in targets:  # one engine refusing (a group) or down must not keep the others loaded
            try:
                results[target] = await call_engine(self.client, CallMethod.UNLOAD, timeout=60.0, engine=target)
            except APIError as exc:
                results[target] = exc.to_dict()
        resp.media = {"engines": results}


class Stats:
    """The engine's figures (`CALL stats`) plus this worker's id and its open engine requests."""

    def __init__(self, client: EnginePool):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        frontend = {"id": self.client.frontend_id, "open_streams": len(self.client.streams)}
        if not isinstance(self.client, EnginePool) or self.client.single:
            stats: dict[str, Any] = await call_engine(self.client, CallMethod.STATS)
            stats["frontend"] = frontend
            resp.media = stats
            return
        # Several engines: each one's figures (or why it did not answer), and this worker's routing view.
        answers = await self.client.call_each(CallMethod.STATS)
        engines = []
        for engine_id, answer in answers.items():
            link = self.client.links[engine_id]
            entry: dict[str, Any] = {"id": engine_id, "endpoint": getattr(link, "endpoint", None),
                                     "routing_state": self.client.state_of(engine_id)}
            entry.update(answer if isinstance(answer, dict) else {"error": str(answer)})
            engines.append(entry)
        resp.media = {"engines": engines, "frontend": frontend}
