"""The falcon.asgi application: `gunicorn 'http_frontend.app:create_app()'`.

Configuration comes from the environment (the `frontend` command sets it from
its flags), so plain gunicorn invocations and HUP reloads see the same settings.
Tests build the same app with injected settings and a stand-in engine client
(`create_app(settings=..., engine=...)`) and drive it in-process.
"""

from __future__ import annotations

import logging
from typing import Any

import falcon.asgi
from falcon.routing import CompiledRouter

from http_frontend import errors
from http_frontend.anthropic.messages import CountTokens, Messages
from http_frontend.engine.client import EngineLink
from http_frontend.engine.pool import EnginePool, build_pool
from http_frontend.engine.pool_config import epsilon_from_env, min_bound_from_env, parse_specs, specs_from_env
from http_frontend.middleware.auth import security_middleware
from http_frontend.middleware.disconnect import DisconnectWatch
from http_frontend.middleware.observer import RequestObserver, route_finder
from http_frontend.openai.audio import Speech, Transcriptions
from http_frontend.openai.chat import ChatCompletions
from http_frontend.openai.completions import Completions
from http_frontend.openai.embeddings import Embeddings
from http_frontend.openai.responses import ResponseById, Responses
from http_frontend.openai.tokenize import Detokenize, Tokenize, TokenizerInfo
from http_frontend.playground.resource import add_playground
from http_frontend.service.adapters import AdapterByName, Adapters
from http_frontend.service.admin import Stats, Unload
from http_frontend.service.engines import EngineDrain, Engines
from http_frontend.service.health import Health
from http_frontend.service.metrics import FrontendMetrics, MetricsResource
from http_frontend.service.models import ModelById, Models
from http_frontend.service.openapi import OpenAPIResource
from http_frontend.settings import REQUEST_TIMEOUT_ENV, FrontendSettings, configure_logging  # noqa: F401 (re-export)

log = logging.getLogger(__name__)


class EngineLifespan:
    """Creates the worker's DEALERs in ASGI startup (after the fork), closes it at shutdown."""

    def __init__(self, client: EngineLink):
        self.client = client

    async def process_startup(self, scope: dict[str, Any], event: dict[str, Any]) -> None:
        await self.client.start()

    async def process_shutdown(self, scope: dict[str, Any], event: dict[str, Any]) -> None:
        await self.client.close()


def answer_head(resource: object, suffix: str | None = None) -> object:
    """HEAD of a GET route answers as GET does, without the body (falcon drops it, keeps Content-Length).

    Health probes and uptime monitors send HEAD: a 405 read as down. A resource's own `on_head` stays.
    """
    tail = f"_{suffix}" if suffix else ""
    get = getattr(resource, f"on_get{tail}", None)
    if get is not None and getattr(resource, f"on_head{tail}", None) is None:
        setattr(resource, f"on_head{tail}", get)
    return resource


def add_route(app: falcon.asgi.App, path: str, resource: object, suffix: str | None = None) -> None:
    """Every API route also answers without the /v1 prefix, as mlx_vlm.server does; HEAD wherever GET."""
    answer_head(resource, suffix)
    app.add_route(path, resource, suffix=suffix)
    if path.startswith("/v1/"):
        app.add_route(path[3:], resource, suffix=suffix)


def create_app(endpoint: str | None = None, *, settings: FrontendSettings | None = None,
               engine: EngineLink | None = None) -> DisconnectWatch:
    """One worker's ASGI app: every route, the middleware and error handlers, around one engine client.

    gunicorn calls it bare (`create_app()`): settings from the environment and an
    `EnginePool` of one `EngineClient` per engine: `endpoint`, else the engines of
    MLX_ENGINE_ENDPOINTS, else MLX_ENGINE_ENDPOINT, else the per-user socket. Tests
    inject `settings` and `engine`, any object with the members of `EngineLink`
    (wrapped in a pool of one; the app's lifespan still starts and closes it), and
    drive the app in-process.
    """
    if engine is not None and endpoint is not None:
        raise TypeError("create_app takes an endpoint or an engine client, not both")
    if settings is None:
        settings = FrontendSettings.from_env()
    configure_logging(settings.log_level)
    if engine is not None:
        client = engine if isinstance(engine, EnginePool) else EnginePool({"engine": engine})
    elif endpoint is not None:
        client = build_pool(parse_specs([endpoint]), epsilon_from_env(), settings.max_pending_bytes,
                            min_bound_from_env())
    else:  # --endpoint (repeatable) through MLX_ENGINE_ENDPOINTS, else MLX_ENGINE_ENDPOINT, else the user socket
        client = build_pool(specs_from_env(), epsilon_from_env(), settings.max_pending_bytes, min_bound_from_env())
    metrics = FrontendMetrics(client)
    router = CompiledRouter()  # also names the route of requests refused before routing (metric labels)
    app = falcon.asgi.App(middleware=[EngineLifespan(client), *security_middleware(settings)], router=router)
    errors.install(app)
    add_route(app, "/v1/chat/completions", ChatCompletions(client, settings.request_timeout, settings=settings,
                                                           metrics=metrics))
    add_route(app, "/v1/completions", Completions(client, settings.request_timeout, settings=settings,
                                                  metrics=metrics))
    add_route(app, "/v1/messages", Messages(client, settings.request_timeout, settings=settings, metrics=metrics))
    add_route(app, "/v1/messages/count_tokens", CountTokens(client, settings))
    add_route(app, "/v1/responses", Responses(client, settings.request_timeout, settings=settings, metrics=metrics))
    responses_by_id = ResponseById(client)
    add_route(app, "/v1/responses/{response_id}", responses_by_id)
    add_route(app, "/v1/responses/{response_id}/input_items", responses_by_id, suffix="input_items")
    add_route(app, "/v1/responses/{response_id}/cancel", responses_by_id, suffix="cancel")
    add_route(app, "/v1/audio/transcriptions", Transcriptions(client, settings, "transcribe", settings.request_timeout))
    add_route(app, "/v1/audio/translations", Transcriptions(client, settings, "translate", settings.request_timeout))
    add_route(app, "/v1/audio/speech", Speech(client, settings, settings.request_timeout))
    add_route(app, "/v1/embeddings", Embeddings(client, settings))
    add_route(app, "/v1/tokenize", Tokenize(client, settings))
    add_route(app, "/v1/detokenize", Detokenize(client, settings))
    add_route(app, "/v1/tokenizer_info", TokenizerInfo(client))
    add_route(app, "/v1/models", Models(client))
    add_route(app, "/v1/adapters", Adapters(client, settings))
    add_route(app, "/v1/adapters/{name}", AdapterByName(client))
    add_route(app, "/v1/models/{model_id:path}", ModelById(client))  # ids may hold a slash: org/name
    add_route(app, "/health", Health(client))
    add_route(app, "/unload", Unload(client))
    add_route(app, "/stats", Stats(client))
    add_route(app, "/metrics", MetricsResource(metrics))
    add_route(app, "/admin/engines", Engines(client))
    drain = EngineDrain(client)
    add_route(app, "/admin/engines/{engine_id}/drain", drain)
    add_route(app, "/admin/engines/{engine_id}/undrain", drain, suffix="undrain")
    add_route(app, "/openapi.json", OpenAPIResource())
    if settings.playground:
        add_playground(app)  # GET / and /playground: the browser page (--no-playground turns it off)
    return DisconnectWatch(RequestObserver(app, metrics, route_finder(router)))
