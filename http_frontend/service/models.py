"""GET /v1/models and /v1/models/{model_id}: the engine's catalogue as OpenAI model objects.

The engine knows what can be served (the operator's aliases, models under
--model-dir and in the HF cache, the loaded one); the front-end only renders it.
"""

from __future__ import annotations

import time
from typing import Any

import falcon.asgi

from http_frontend.engine.calls import call_engine
from http_frontend.engine.client import EngineClient
from http_frontend.errors import APIError
from protocol import CallMethod

# Listing walks the model roots and the HF cache on the engine's io thread.
LIST_TIMEOUT = 30.0


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
        models = await call_engine(self.client, CallMethod.LIST_MODELS, timeout=LIST_TIMEOUT)
        resp.media = {"object": "list", "data": [model_object(m) for m in models]}


class ModelById:
    """GET /v1/models/{model_id}: one model of the catalogue. Ids may hold slashes (`org/name`)."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model_id: str) -> None:
        models = await call_engine(self.client, CallMethod.LIST_MODELS, timeout=LIST_TIMEOUT)
        found = next((m for m in models if m["id"] == model_id), None)
        if found is None:
            listed = ", ".join(m["id"] for m in models[:20]) or "none"
            raise APIError(404, f"The model '{model_id}' does not exist. Available models: {listed}",
                           code="model_not_found", param="model")
        resp.media = model_object(found)
