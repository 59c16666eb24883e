"""Service routes: /v1/models, /health, /unload, /stats — each a CALL to the engine."""

from __future__ import annotations

import time
from typing import Any

import falcon
import falcon.asgi

from http_frontend.engine_client import EngineClient, EngineError, EngineUnavailable
from http_frontend.errors import APIError


async def call_engine(client: EngineClient, method: str, timeout: float = 5.0,
                      args: dict[str, Any] | None = None) -> Any:
    """A CALL whose failures come back as APIError: 503 when unreachable, the engine's own error otherwise."""
    try:
        return await client.call(method, args, timeout=timeout)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "1"}) from None
    except EngineError as exc:
        raise APIError.from_engine(exc.body) from None


class Models:
    """OpenAI model list: MLX models in the engine host's HF cache plus the loaded one."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        models = await call_engine(self.client, "list_models", timeout=30.0)
        resp.media = {"object": "list", "data": [
            {"id": m["id"], "object": "model", "created": m.get("created", int(time.time())),
             "owned_by": "local", "loaded": m.get("loaded", False)} for m in models]}


class Health:
    """200 with the loaded model while the engine answers; 503 when it does not."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        try:
            status = await self.client.call("status", timeout=2.0)
        except (EngineUnavailable, EngineError) as exc:
            resp.status = falcon.HTTP_503
            resp.set_header("Retry-After", "1")
            resp.media = {"status": "unhealthy", "error": str(exc), "loaded_model": None, "loaded_adapter": None}
            return
        stalled = status["state"] == "stalled"
        if stalled:
            # Alive (it answers) but wedged: distinct from unreachable, and not able to serve.
            resp.status = falcon.HTTP_503
            resp.set_header("Retry-After", "5")
        resp.media = {"status": "stalled" if stalled else "healthy", "loaded_model": status["model"],
                      "loaded_adapter": status["adapter"],
                      "engine": {k: status[k] for k in ("state", "epoch", "uptime", "pid", "queued", "running",
                                                         "model_loads", "busy_seconds")}}


class Unload:
    def __init__(self, client: EngineClient):
        self.client = client

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = await call_engine(self.client, "unload", timeout=60.0)


class Stats:
    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        stats: dict[str, Any] = await call_engine(self.client, "stats")
        stats["frontend"] = {"id": self.client.frontend_id, "open_streams": len(self.client.streams)}
        resp.media = stats
