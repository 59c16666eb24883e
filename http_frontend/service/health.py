"""GET /health: whether this worker's engine can serve, for load balancers and orchestrators.

Public (no API key) and answered from one `status` CALL with a short timeout: 200
with the loaded model while the engine answers, 503 with `Retry-After` when it does
not or when its mlx thread is stalled.
"""

from __future__ import annotations

import falcon
import falcon.asgi

from http_frontend.engine.client import EngineClient, EngineError, EngineUnavailable
from protocol import CallMethod


class Health:
    """200 with the loaded model while the engine answers; 503 when it does not."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        try:
            status = await self.client.call(CallMethod.STATUS, timeout=2.0)
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
