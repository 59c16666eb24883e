"""The falcon.asgi application: `gunicorn 'http_frontend.app:create_app()'`.

Configuration comes from the environment (the `frontend` command sets it from
its flags), so plain gunicorn invocations and HUP reloads see the same settings.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import falcon.asgi

from http_frontend import admin, errors
from http_frontend.chat import ChatCompletions
from http_frontend.disconnect import DisconnectWatch
from http_frontend.engine_client import EngineClient
from protocol.endpoints import default_endpoint

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_ENV = "MLX_FRONTEND_REQUEST_TIMEOUT"


class EngineLifespan:
    """Creates the worker's DEALER in ASGI startup (after the fork), closes it at shutdown."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def process_startup(self, scope: dict[str, Any], event: dict[str, Any]) -> None:
        await self.client.start()

    async def process_shutdown(self, scope: dict[str, Any], event: dict[str, Any]) -> None:
        await self.client.close()


def add_route(app: falcon.asgi.App, path: str, resource: object) -> None:
    """Every API route also answers without the /v1 prefix, as mlx_vlm.server does."""
    app.add_route(path, resource)
    if path.startswith("/v1/"):
        app.add_route(path[3:], resource)


def create_app(endpoint: str | None = None) -> DisconnectWatch:
    client = EngineClient(endpoint or default_endpoint())
    request_timeout = float(os.environ.get(REQUEST_TIMEOUT_ENV, "600"))
    app = falcon.asgi.App(middleware=[EngineLifespan(client)])
    errors.install(app)
    add_route(app, "/v1/chat/completions", ChatCompletions(client, request_timeout))
    add_route(app, "/v1/models", admin.Models(client))
    app.add_route("/health", admin.Health(client))
    app.add_route("/unload", admin.Unload(client))
    app.add_route("/stats", admin.Stats(client))
    return DisconnectWatch(app)
