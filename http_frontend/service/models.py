"""GET /v1/models and /v1/models/{model_id}: the engines' catalogue as OpenAI model objects (their union).

Anthropic's clients (`speaks_anthropic`) get the same catalogue as Anthropic's `ModelInfo` pages.

The engine knows what can be served (the operator's aliases, models under
--model-dir and in the HF cache, the loaded one); the front-end only renders it.
"""

from __future__ import annotations

import time
from typing import Any

import falcon.asgi

from http_frontend.engine.calls import call_engine
from http_frontend.engine.pool import EnginePool
from http_frontend.errors import APIError, speaks_anthropic
from http_frontend.service.anthropic_models import model_info, model_page
from protocol import CallMethod

# Listing walks the model roots and the HF cache on the engine's io thread.
LIST_TIMEOUT = 30.0
# A name resolves on the engine's admission pool, behind prompts being rendered.
RESOLVE_TIMEOUT = 30.0


def model_object(m: dict[str, Any]) -> dict[str, Any]:
    """A catalogue entry of the engine as an OpenAI model object, with this server's extra fields."""
    kind = m.get("kind") or "text"
    return {"id": m["id"], "object": "model", "created": m.get("created", int(time.time())), "owned_by": "local",
            "context_window": m.get("context_window"), "type": kind, "kind": kind, "loaded": m.get("loaded", False)}


async def catalogue(client: EnginePool) -> list[dict[str, Any]]:
    """The engines' catalogues in one list (an id once; `loaded` when any engine has it loaded).

    One engine: its list, or its error. Several: the union of those that answer, a 503 only
    when none does.
    """
    if not isinstance(client, EnginePool) or client.single:
        return await call_engine(client, CallMethod.LIST_MODELS, timeout=LIST_TIMEOUT)
    answers = await client.call_each(CallMethod.LIST_MODELS, timeout=LIST_TIMEOUT)
    lists = [answer for answer in answers.values() if isinstance(answer, list)]
    if not lists:
        return await call_engine(client, CallMethod.LIST_MODELS, timeout=LIST_TIMEOUT)  # the first one's error
    merged: dict[str, dict[str, Any]] = {}
    for models in lists:
        for m in models:
            seen = merged.setdefault(m["id"], dict(m))
            if m.get("loaded") and not seen.get("loaded"):
                merged[m["id"]] = dict(m)
    return list(merged.values())


class Models:
    """OpenAI model list: the operator's aliases, MLX models under --model-dir and in the HF cache, the loaded one."""

    def __init__(self, client: EnginePool):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        models = await catalogue(self.client)
        if speaks_anthropic(req):  # Anthropic's SDKs: a page of `ModelInfo`
            resp.media = model_page(models, req)
        else:
            resp.media = {"object": "list", "data": [model_object(m) for m in models]}


async def served_as(client: EnginePool, name: str) -> dict[str, Any] | None:
    """What the engines say a request naming `name` runs on (`resolve_model`); None when none would serve it.

    Several engines: the first (in the pool's order) whose loaded model serves it, else the first that knows it.
    """
    if not isinstance(client, EnginePool) or client.single:
        try:
            return await call_engine(client, CallMethod.RESOLVE_MODEL, timeout=RESOLVE_TIMEOUT, args={"model": name})
        except APIError:  # unknown (404), refused outright (400), or an engine that predates the CALL
            return None
    answers = await client.call_each(CallMethod.RESOLVE_MODEL, {"model": name}, timeout=RESOLVE_TIMEOUT)
    known = [answer for answer in answers.values() if isinstance(answer, dict)]
    return next((answer for answer in known if answer.get("loaded")), known[0] if known else None)


class ModelById:
    """GET /v1/models/{model_id}: one model of the catalogue. Ids may hold slashes (`org/name`).

    A name that is not in the catalogue but that a chat request would still be served under (an agent's
    `claude-…` under --model-fallback or a glob alias, another spelling of a model's path) is found too,
    under the name asked for, with the serving model's fields: clients retrieve a model before using it.
    A model of an engine that is down is a 503 with Retry-After, as a request to run it is.
    """

    def __init__(self, client: EnginePool):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model_id: str) -> None:
        models = await catalogue(self.client)
        found = next((m for m in models if m["id"] == model_id), None)
        if found is None:
            served = await served_as(self.client, model_id)
            if served is not None:
                entry = next((m for m in models if m["id"] == served.get("id")), served)
                found = {**entry, "id": model_id, "loaded": bool(served.get("loaded") or entry.get("loaded"))}
        outage = self.client.outage_message(model_id) if found is None and isinstance(self.client, EnginePool) else None
        if outage:  # the model of an engine that is down: its outage, as generation answers, not "no such model"
            raise APIError(503, outage, code="engine_unavailable", headers={"Retry-After": "1"})
        if found is None:
            listed = ", ".join(m["id"] for m in models[:20]) or "none"
            raise APIError(404, f"The model '{model_id}' does not exist. Available models: {listed}",
                           code="model_not_found", param="model")
        resp.media = model_info(found) if speaks_anthropic(req) else model_object(found)
