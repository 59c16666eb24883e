"""What every generation route shares: submit, wait for ACCEPTED, answer SSE or JSON, release.

Chat Completions, Completions, Responses and Anthropic Messages differ only in how
they read a request and render updates; the path between the HTTP request and the
engine is this one. `serve_generation` submits the ADD (n of them for `n` choices),
waits for ACCEPTED (or turns the refusal into an HTTP error before any byte goes
out) and hands the stream to the route's `events` (SSE) or `complete` (JSON);
`relay` yields the merged updates with a keep-alive tick every idle second, and
every engine request is released (ABORTed unless finished) on every path.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import falcon.asgi
from falcon.asgi import SSEvent

from http_frontend.engine.client import EngineClient, EngineError, EngineLink, EngineUnavailable, RequestStream, Update
from http_frontend.engine.frames import UnsendableRequest
from http_frontend.engine.pool import MODEL_REFUSALS, EnginePool, RouteHint
from http_frontend.engine.routing import AFFINITY_HEADERS, affinity_key
from http_frontend.errors import APIError
from http_frontend.middleware.auth import caller_of
from http_frontend.middleware.disconnect import disconnected_event
from http_frontend.parsing.body import check_model_name
from http_frontend.relay.choices import choice_requests, merge_event_streams, merge_results
from http_frontend.relay.context_overflow import report_context_overflow
from http_frontend.service.metrics import RID_KEY, FrontendMetrics, TokenTimer
from http_frontend.settings import FrontendSettings

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 1.0


def usage_object(usage: dict[str, int] | None) -> dict[str, Any] | None:
    """The engine's usage in the Chat Completions / Completions shape (`merge_usage` sums these for n > 1)."""
    if usage is None:
        return None
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)}}


class GenerationRoute:
    """What every generation route holds: the engine client, limits and metrics."""

    def __init__(self, client: EngineClient, request_timeout: float, *, settings: FrontendSettings | None = None,
                 metrics: FrontendMetrics | None = None):
        self.client = client
        self.request_timeout = request_timeout
        self.settings = settings or FrontendSettings()
        self.metrics = metrics or FrontendMetrics(client)

    async def sse(self, stream: RequestStream, timer: TokenTimer, render: Callable[[Update], list[SSEvent]],
                  first: SSEvent | None = None, done: bool = True) -> AsyncIterator[SSEvent | None]:
        """The SSE body of a generation route: `render` turns each merged update into events.

        Keep-alive comments while idle (a gone client is noticed within a second), an
        error event for engine errors, `[DONE]` last (unless `done` is False: Anthropic's
        grammar ends with its own message_stop), and the request released on every
        path, a vanished client included (falcon closes the generator).
        """
        reason = "client_disconnected"
        self.metrics.stream_opened()
        try:
            if first is not None:
                yield first
            async for update in relay(stream, self.request_timeout):
                if update is None:
                    yield None
                    continue
                timer.on_update(update)
                for event in render(update):
                    yield event
            reason = "finished"
        except APIError as exc:
            reason = "error"
            yield SSEvent(json=exc.to_dict())
        finally:
            self.client.release(stream, reason)
            self.metrics.stream_closed()
        if done:
            yield SSEvent(data=b"[DONE]")



async def serve_generation(
        req: falcon.asgi.Request, resp: falcon.asgi.Response, client: EngineClient, request_timeout: float,
        metrics: FrontendMetrics, engine_request: dict[str, Any] | list[dict[str, Any]], id_prefix: str,
        model: str | None, stream_requested: bool,
        events: Callable[[RequestStream, dict[str, Any], TokenTimer], AsyncIterator[SSEvent | None]],
        complete: Callable[[RequestStream, dict[str, Any], TokenTimer], Awaitable[dict[str, Any]]],
        n: int = 1, include_usage: bool = False) -> None:
    """Submit, wait for ACCEPTED, then answer SSE (`events`) or JSON (`complete`).

    Shared by every generation route. With `n` > 1 the n engine requests' answers
    are merged into one (`merge_results`, `merge_event_streams`); `engine_request` may be a list
    (/v1/completions' prompts), each with its n choices, whose streams say which (`prompt_index`).
    Each request is released (ABORTed unless it finished) on every path: here for JSON answers and refusals,
    by `events`' own `finally` once the SSE generator has been handed to falcon.
    """
    streams: list[RequestStream] = []
    handed_over, reason = False, "request_ended"
    # Whose share of the engine's decode slots this is: the key's digest, else the named end user.
    client_id = caller_of(req).client or getattr(req.context, "end_user", None)
    requests = engine_request if isinstance(engine_request, list) else [engine_request]
    if client_id:
        requests = [{**request, "client": client_id} for request in requests]
    hint = route_hint(req, requests[0])
    try:
        bodies = [body for request in requests for body in choice_requests(request, n)]
        for body in bodies:
            streams.append(await submit_or_503(client, body, hint))
            hint = RouteHint(hint.key, hint.model, streams[0].engine_id)  # n choices share one engine's cache
        req.scope[RID_KEY] = streams[0].rid  # for the access line: the engine logs the same rid
        timer = metrics.token_timer(req.scope)
        # A client that leaves while its request waits in the engine's queue aborts it too.
        accepted = [await accepted_somewhere(req, client, streams, index, body, hint, request_timeout)
                    for index, body in enumerate(bodies)]
        req.scope[RID_KEY] = streams[0].rid  # a request passed to another engine has a new rid
        for index, stream in enumerate(streams):
            stream.prompt_index = index // n
        resp.set_header("X-Request-Id", streams[0].rid)
        resp.set_header("Request-Id", streams[0].rid)  # where Anthropic's SDKs read it (`_request_id`)
        if streams[0].engine_id:
            resp.set_header("X-Engine-Id", streams[0].engine_id)
        meta = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": accepted[0].get("model") or model}
        if stream_requested:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            bodies = [events(stream, meta, timer) for stream in streams]
            resp.sse = bodies[0] if len(bodies) == 1 else merge_event_streams(bodies, include_usage, n)
            handed_over = True
        else:
            async def complete_all() -> list[dict[str, Any]]:
                # A coroutine, not a bare gather future: cancelling its task on disconnect cancels every
                # choice cleanly (a cancelled gather future would log "exception was never retrieved").
                return list(await asyncio.gather(*(complete(s, meta, timer) for s in streams)))

            results = await until_disconnect(req, complete_all())
            resp.media = results[0] if len(results) == 1 else merge_results(results, n)
        report_context_overflow(resp, accepted[0])  # header, and usage.context_overflow in JSON answers
    except APIError as exc:
        if exc.code == "client_disconnected":
            reason = exc.code
        raise
    finally:
        if not handed_over:
            for stream in streams:
                client.release(stream, reason)


LOST_ENGINE_CODES = ("engine_unavailable", "engine_restarted", "engine_group_failed", "engine_shutting_down")


async def accepted_somewhere(req: falcon.asgi.Request, client: EngineLink, streams: list[RequestStream], index: int,
                             body: dict[str, Any], hint: RouteHint, timeout: float) -> dict[str, Any]:
    """ACCEPTED for `streams[index]`; behind several engines, one lost before it accepted passes the
    request to another (nothing was generated yet), so a freeze costs that client a wait, not a 503."""
    lost: set[str] = set()
    while True:
        stream = streams[index]
        try:
            return await until_disconnect(req, wait_accepted(stream, timeout))
        except APIError as exc:
            outage = (client.outage_message(hint.model, lost | stream.passed_over)
                      if exc.code in MODEL_REFUSALS and isinstance(client, EnginePool) else None)
            if outage:
                # Another engine refused a model whose own engine is down: that is the engine's outage, and
                # a client retries a 503 (a 400 told it the request itself was wrong).
                raise APIError(503, outage, code="engine_unavailable", headers={"Retry-After": "1"}) from None
            # A group that just failed is lost the same way (its newest requests were not accepted either).
            if (exc.code not in LOST_ENGINE_CODES or not isinstance(client, EnginePool)
                    or client.single or stream.engine_id is None):
                raise
            lost.add(stream.engine_id)
            log.warning("engine %s was lost before it accepted rid=%s: trying another", stream.engine_id, stream.rid)
            client.release(stream, "engine_unavailable")
            try:
                streams[index] = await client.submit(body, RouteHint(hint.key, hint.model), exclude=frozenset(lost))
            except EngineUnavailable:
                raise exc from None


async def until_disconnect(req: falcon.asgi.Request, work: Any) -> Any:
    """Awaits `work` unless the client hangs up first (then the caller's finally aborts the request)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected_event(req.scope).wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "The client closed the connection", code="client_disconnected")
    return task.result()


def route_hint(req: falcon.asgi.Request, engine_request: dict[str, Any]) -> RouteHint:
    """What the router keys a request on (`routing.affinity_key`): session headers, then the body's hints.

    `read_json_object` leaves `prompt_cache_key` and the end user on `req.context`; the Responses
    route leaves the previous response's id and its engine there.
    """
    context = req.context
    previous = getattr(context, "previous_response_id", None)
    key = affinity_key({name: req.get_header(name) or "" for name in AFFINITY_HEADERS},
                       previous_response_id=previous, prompt_cache_key=getattr(context, "prompt_cache_key", None),
                       user=getattr(context, "end_user", None), engine_request=engine_request)
    return RouteHint(key, engine_request.get("model"),
                     getattr(context, "response_engine", None) if previous else None)


async def submit_or_503(client: EngineLink, request: dict[str, Any], hint: RouteHint | None = None) -> RequestStream:
    """The ADD sent; 503 when the engine is unreachable, 413 / 400 when the wire cannot carry it."""
    check_model_name(request.get("model"))
    try:
        if isinstance(client, EnginePool):
            return await client.submit(request, hint)
        return await client.submit(request)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "1"}) from None
    except UnsendableRequest as exc:
        raise exc.api_error() from None


async def wait_accepted(stream: RequestStream, timeout: float) -> dict[str, Any]:
    """ACCEPTED, or the engine's refusal as an HTTP error (before any byte of the response)."""
    try:
        return await stream.wait_accepted(timeout)
    except EngineError as exc:
        raise APIError.from_engine(exc.body) from None
    except asyncio.TimeoutError:
        raise APIError(504, f"The engine did not start the request within {timeout:.0f} s",
                       code="timeout", error_type="server_error") from None


async def relay(stream: RequestStream, timeout: float) -> AsyncIterator[Any]:
    """Merged updates until the request finishes; None every idle second (for keep-alives).

    Engine errors surface as APIError; a request idle past `timeout` is a 504-style error.
    """
    idle_since = time.monotonic()
    while True:
        try:
            update = await stream.next_update(KEEPALIVE_SECONDS)
        except EngineError as exc:
            raise APIError.from_engine(exc.body) from None
        if update is None:
            if time.monotonic() - idle_since > timeout:
                raise APIError(504, "The engine produced nothing for too long", code="timeout",
                               error_type="server_error")
            yield None
            continue
        idle_since = time.monotonic()
        yield update
        if update.finish_reason:
            return
