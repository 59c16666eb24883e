"""/v1/adapters: the engine's LoRA adapter registry (list, register by name, remove).

A registered name is what requests then send as `adapter_path`. The engine checks
the path (only directories under its --model-dir roots) and the adapter itself
(mlx-lm format, and that it fits the loaded model) before registering it; this
module only validates shapes and translates errors.
"""

from __future__ import annotations

import re

import falcon
import falcon.asgi

from http_frontend.engine.calls import call_engine
from http_frontend.engine.client import EngineClient
from http_frontend.errors import bad_request
from http_frontend.parsing.body import get_field, read_json_object
from http_frontend.settings import FrontendSettings
from protocol import CallMethod

# Same rule as the engine's (engine_daemon.lora.registry.NAME_PATTERN): checked here too for a clear 400 early.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
CALL_TIMEOUT = 30.0  # registering reads the adapter on the mlx thread, which may be mid-step


class Adapters:
    """GET: the registered adapters. POST {name, path}: register one."""

    admin_methods = frozenset({"POST"})  # changes what every client may use: the admin role's (`needs_admin`)

    def __init__(self, client: EngineClient, settings: FrontendSettings | None = None):
        self.client = client
        self.settings = settings or FrontendSettings()

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        result = await call_engine(self.client, CallMethod.ADAPTERS_LIST)
        resp.media = {"object": "list", "data": result["data"]}

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        name = get_field(body, "name", (str,), required=True)
        if not NAME_PATTERN.match(name):
            raise bad_request("An adapter 'name' is 1-64 letters, digits, '.', '_' or '-' and starts with a letter "
                              "or digit", param="name")
        path = get_field(body, "path", (str,), required=True)
        if not path.strip() or "\0" in path:
            raise bad_request("'path' must name an adapter directory", param="path")
        resp.media = await call_engine(self.client, CallMethod.ADAPTERS_ADD, CALL_TIMEOUT, {"name": name, "path": path})


class AdapterByName:
    """DELETE: unregister an adapter (requests running with it finish with it)."""

    admin_methods = frozenset({"DELETE"})  # changes what every client may use: the admin role's (`needs_admin`)

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_delete(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, name: str) -> None:
        resp.media = await call_engine(self.client, CallMethod.ADAPTERS_REMOVE, CALL_TIMEOUT, {"name": name})
