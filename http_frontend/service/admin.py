"""Service routes: /v1/models, /health, /unload, /stats — each a CALL to the engine."""

from __future__ import annotations

import time
from typing import Any

import falcon
import falcon.asgi

from http_frontend.engine.client import EngineClient, EngineError, EngineUnavailable
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


def model_object(m: dict[str, Any]) -> dict[str, Any]:
    """A catalogue entry of the engine as an OpenAI model object, with this server's extra fields."""
    kind = m.get("kind") or "text"
    return {"id": m["id"], "object": "model", "created": m.get("created", int(time.time())), "owned_by": "local",
            "context_window": m.get("context_window"), "type": kind, "kind": kind, "loaded": m.get("loaded", False)}


class Models:
    """OpenAI model list: the operator's aliases, MLX models under --model-dir and in the HF cache, the loaded one."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        models = await call_engine(self.client, "list_models", timeout=30.0)
        resp.media = {"object": "list", "data": [model_object(m) for m in models]}


class ModelById:
    """GET /v1/models/{model_id}: one model of the catalogue. Ids may hold slashes (`org/name`)."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model_id: str) -> None:
        models = await call_engine(self.client, "list_models", timeout=30.0)
        found = next((m for m in models if m["id"] == model_id), None)
        if found is None:
            listed = ", ".join(m["id"] for m in models[:20]) or "none"
            raise APIError(404, f"The model '{model_id}' does not exist. Available models: {listed}",
                           code="model_not_found", param="model")
        resp.media = model_object(found)


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
            resp.media = {"status": "unhealthy", "error": str(exc), "loaded_model": None, "loaded_model_kind": None,
                          "loaded_adapter": None}
            return
        stalled = status["state"] == "stalled"
        if stalled:
            # Alive (it answers) but wedged: distinct from unreachable, and not able to serve.
            resp.status = falcon.HTTP_503
            resp.set_header("Retry-After", "5")
        resp.media = {"status": "stalled" if stalled else "healthy", "loaded_model": status["model"],
                      "loaded_model_kind": status.get("model_kind"),  # "text" | "vision" | "audio"
                      "loaded_adapter": status["adapter"],
                      "engine": {k: status[k] for k in ("state", "epoch", "uptime", "pid", "queued", "running",
                                                         "model_loads", "busy_seconds")}}
        # While a model loads: which one and for how long (state "loading").
        resp.media["engine"].update(loading_model=status.get("loading_model"),
                                    loading_seconds=status.get("loading_seconds"))
        if status.get("downloaded_bytes") is not None:  # a Hub download in progress
            resp.media["engine"]["downloaded_bytes"] = status["downloaded_bytes"]


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
