"""POST /v1/messages and /v1/messages/count_tokens: Anthropic Messages <-> protocol ADD / DELTAS.

A pure translation layer over the chat route's machinery: the request becomes a chat
ADD (`engine_request`), submission, relaying and release are the shared
`serve_generation` / `GenerationRoute.sse`, and updates become content blocks and
Anthropic's stream events (`BlockBuilder`, `anthropic_sse`). Errors on these paths come back in
Anthropic's envelope (`is_anthropic_path` switches on the path). The
`anthropic-version` header is accepted and not needed: there is one version of this API here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import falcon.asgi
from falcon.asgi import SSEvent

from http_frontend.anthropic.request import engine_request
from http_frontend.anthropic.stream import (
    BlockBuilder,
    anthropic_sse,
    engine_usage,
    event,
    message,
    stop_reason,
    usage,
)
from http_frontend.anthropic.tools import hosted_tools
from http_frontend.engine.calls import TOKENIZE_TIMEOUT, call_engine
from http_frontend.engine.client import EngineClient, RequestStream, Update
from http_frontend.parsing.body import get_field, read_json_object
from http_frontend.parsing.documents import has_pdf_documents
from http_frontend.parsing.generation_fields import ignored_tools_header
from http_frontend.parsing.media import MediaCollector
from http_frontend.relay.generation import GenerationRoute, relay, serve_generation
from http_frontend.service.metrics import TokenTimer
from http_frontend.settings import FrontendSettings
from protocol import CallMethod


def _anthropic_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """serve_generation's meta with an Anthropic-style id (`msg_…`)."""
    return {**meta, "id": "msg_" + meta["id"].split("-", 1)[-1]}



log = logging.getLogger(__name__)

async def translated(body: dict[str, Any], settings: FrontendSettings, **kwargs: Any) -> dict[str, Any]:
    """`engine_request`, off the event loop when PDFs must be read (CPU work other streams must not wait on)."""
    if has_pdf_documents(body):
        return await asyncio.to_thread(engine_request, body, settings, **kwargs)
    return engine_request(body, settings, **kwargs)

class Messages(GenerationRoute):
    """POST /v1/messages: validates, submits a chat request, answers a message or its event stream."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        media = MediaCollector.for_request(body, self.settings)
        request = await translated(body, self.settings, media=media)
        ignored = hosted_tools(body)
        if ignored:
            log.info("Anthropic-hosted tools the engine cannot run were left out: %s", ", ".join(ignored))
            resp.set_header("X-Ignored-Tools", ignored_tools_header(ignored))
        resolved = await media.resolve()  # fetches http(s) images: after every other check
        if resolved:
            request["media"] = resolved
        stream_requested = get_field(body, "stream", (bool,), default=False)
        await serve_generation(req, resp, self.client, self.request_timeout, self.metrics, request, "msg",
                               request.get("model"), stream_requested, events=self._events, complete=self._complete)

    async def _complete(self, stream: RequestStream, meta: dict[str, Any], timer: TokenTimer) -> dict[str, Any]:
        builder = BlockBuilder()
        finish_reason, stop_sequence, raw_usage = None, None, None
        async for update in relay(stream, self.request_timeout):
            if update is None:
                continue
            timer.on_update(update)
            builder.feed(update)
            if update.finish_reason:
                finish_reason, stop_sequence, raw_usage = update.finish_reason, update.stop_sequence, update.usage
        builder.finish()
        return message(_anthropic_meta(meta), builder.blocks,
                       stop_reason(finish_reason, stop_sequence, builder.has_tool_use), engine_usage(raw_usage))

    def _events(self, stream: RequestStream, meta: dict[str, Any], timer: TokenTimer) -> AsyncIterator[SSEvent]:
        builder = BlockBuilder()
        accepted = stream.accepted or {}
        start = message(_anthropic_meta(meta), [], (None, None),
                        usage(accepted.get("prompt_tokens", 0), 0, accepted.get("cached_tokens", 0)))

        def render(update: Update) -> list[SSEvent]:
            payloads = builder.feed(update)
            if update.finish_reason:
                payloads += builder.finish()
                reason, stop_sequence = stop_reason(update.finish_reason, update.stop_sequence,
                                                    builder.has_tool_use)
                payloads.append({"type": "message_delta",
                                 "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                 "usage": engine_usage(update.usage)})
                payloads.append({"type": "message_stop"})
            return [event(payload) for payload in payloads]

        return anthropic_sse(self.sse(stream, timer, render, first=event({"type": "message_start", "message": start}),
                                      done=False))


class CountTokens:
    """POST /v1/messages/count_tokens: the prompt the same /v1/messages request would have, counted by the engine."""

    def __init__(self, client: EngineClient, settings: FrontendSettings | None = None):
        self.client = client
        self.settings = settings or FrontendSettings()

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        request = await translated(body, self.settings, generation=False)
        args = {key: request.get(key) for key in ("model", "messages", "chat_template_kwargs", "tools")}
        if request.get("tool_choice") == "none":
            args["tools"] = None  # as for generation: a model told to use no tool is not shown any
        result = await call_engine(self.client, CallMethod.TOKENIZE, TOKENIZE_TIMEOUT, args)
        resp.media = {"input_tokens": result["count"]}
