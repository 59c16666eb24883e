"""GET /health: whether this worker's engines can serve, for load balancers and orchestrators.

Public (no API key) and answered from one `status` CALL per engine with a short
timeout: 200 with the loaded model while an engine answers, 503 with `Retry-After`
when none does or when its mlx thread is stalled. Behind several engines it is 200
while at least one serves (not stalled, not draining), with each engine's state in
`engines`; the top-level fields are those of the first engine that serves. With API keys
configured, a caller without one gets the status alone (no model path, endpoints or pids).
"""

from __future__ import annotations

from typing import Any

import falcon
import falcon.asgi

from http_frontend.engine.client import ROUTABLE_STATES, EngineError, EngineUnavailable
from http_frontend.engine.pool import EnginePool
from protocol import CallMethod

ENGINE_FIELDS = ("state", "epoch", "uptime", "pid", "queued", "running", "model_loads", "busy_seconds")


def unhealthy(error: Exception) -> dict[str, Any]:
    return {"status": "unhealthy", "error": str(error), "loaded_model": None, "loaded_model_kind": None,
            "loaded_adapter": None}


def healthy(status: dict[str, Any]) -> dict[str, Any]:
    """The body for an engine that answered `status`: healthy, or stalled (alive but wedged)."""
    media = {"status": "stalled" if status["state"] == "stalled" else "healthy", "loaded_model": status["model"],
             "loaded_model_kind": status.get("model_kind"),  # "text" | "vision" | "audio"
             "loaded_adapter": status["adapter"],
             # the embedding / transcription / speech models loaded beside it (their own slots)
             "auxiliary_models": status.get("auxiliary_models") or [],
             "engine": {k: status[k] for k in ENGINE_FIELDS}}
    # While a model loads: which one and for how long (state "loading").
    media["engine"].update(loading_model=status.get("loading_model"), loading_seconds=status.get("loading_seconds"))
    if status.get("downloaded_bytes") is not None:  # a Hub download in progress
        media["engine"]["downloaded_bytes"] = status["downloaded_bytes"]
    group = status.get("group")
    if group:  # an engine group: its ranks, and which one failed (the engine then says "stalled")
        media["group"] = group
        if group.get("failed"):
            media["status"] = "group_failed"
        elif group.get("checked") is False:  # its ranks' weights not yet compared: it serves nothing yet
            media["status"] = "starting"
    return media


class Health:
    """200 with the loaded model while an engine answers and serves; 503 when none does."""

    def __init__(self, client: EnginePool):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self._answer(resp)
        if getattr(req.context, "anonymous", False):  # keys are configured and none came: no paths, pids, loads
            media = resp.media
            resp.media = {"status": media["status"]}
            if "engines" in media:
                resp.media["engines"] = [{"id": one["id"], "status": one["status"]} for one in media["engines"]]

    async def on_head(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """The same status code for load balancers that probe with HEAD (a 405 failed them); no body."""
        await self.on_get(req, resp)

    async def _answer(self, resp: falcon.asgi.Response) -> None:
        if not isinstance(self.client, EnginePool) or self.client.single:
            await self._one(resp)
            return
        answers = await self.client.call_each(CallMethod.STATUS, timeout=2.0)
        engines, serving = [], []
        for engine_id, answer in answers.items():
            link = self.client.links[engine_id]
            if isinstance(answer, (EngineUnavailable, EngineError)):
                entry = unhealthy(answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                entry = healthy(answer)
                if answer["state"] == "draining":
                    entry["status"] = "draining"
                elif answer["state"] in ROUTABLE_STATES:
                    serving.append(entry)
            engines.append({"id": engine_id, "endpoint": getattr(link, "endpoint", None), **entry})
        if serving:
            media = dict(serving[0])
        else:
            resp.status = falcon.HTTP_503
            resp.set_header("Retry-After", "1")
            media = unhealthy(EngineUnavailable(
                self.client.none_available("No engine can serve (all are down, stalled or draining)")))
        media["engines"] = engines
        resp.media = media

    async def _one(self, resp: falcon.asgi.Response) -> None:
        try:
            status = await self.client.call(CallMethod.STATUS, timeout=2.0)
        except (EngineUnavailable, EngineError) as exc:
            resp.status = falcon.HTTP_503
            resp.set_header("Retry-After", "1")
            resp.media = unhealthy(exc)
            return
        resp.media = healthy(status)
        if status["state"] == "stalled" or resp.media["status"] == "starting":
            # Alive (it answers) but wedged, or a group still checking its ranks: not able to serve.
            resp.status = falcon.HTTP_503
            resp.set_header("Retry-After", "5" if status["state"] == "stalled" else "1")
