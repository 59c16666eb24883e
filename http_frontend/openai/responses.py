"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A Responses request becomes a chat ADD (see responses_items); its output is
rendered by responses_stream. Front-ends keep no state: a finished response
that asks to be stored (`store`, default true) is handed to the engine's store
(`responses.put`) before its last event or its JSON leaves, so a follow-up with
`previous_response_id` works through any worker or host at once. The stored
conversation leaves out `instructions`, which OpenAI does not carry over.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import falcon.asgi
import msgpack
from falcon.asgi import SSEvent

from http_frontend.engine.calls import call_engine
from http_frontend.engine.client import RequestStream, Update
from http_frontend.engine.pool import EnginePool
from http_frontend.errors import APIError, bad_request
from http_frontend.middleware.auth import caller_of
from http_frontend.openai.responses_items import (
    NO_THINKING_EFFORTS,
    TRUNCATION_MODES,
    input_item_list,
    name_tool_results,
    parse_input,
    parse_reasoning,
    parse_text_format,
    parse_tool_choice,
    parse_truncation,
    skips_items,
    tools_of,
)
from http_frontend.openai.responses_replay import replay_events, starting_after
from http_frontend.openai.responses_stream import TERMINAL_EVENTS, Event, ResponseBuilder
from http_frontend.openai.responses_tools import ToolCatalog
from http_frontend.parsing.body import get_field, read_json_object
from http_frontend.parsing.generation_fields import ignored_tools_header
from http_frontend.parsing.generation_fields import parse_reasoning as chat_reasoning
from http_frontend.parsing.media import MediaCollector
from http_frontend.parsing.sampling import parse_sampling
from http_frontend.relay.generation import LOST_ENGINE_CODES, GenerationRoute, relay, serve_generation
from http_frontend.service.metrics import TokenTimer
from protocol import CallMethod
from protocol.messages import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

MAX_ID_LENGTH = 256
# A record travels in one CALL frame: leave room for the frame's other fields.
MAX_RECORD_BYTES = MAX_FRAME_BYTES - 4096

# Fields this server cannot honour: refused with a 400 rather than silently ignored.
UNSUPPORTED = {
    "background": "Background responses are not supported",
    "conversation": "Conversations are not supported; use 'previous_response_id'",
    "prompt": "Prompt templates are not supported",
}
# `include` asks for each output_text's logprobs (other values, e.g. Codex's "reasoning.encrypted_content",
# name things this server has none of: accepted and nothing added).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Engine errors name the chat request's fields: the Responses fields that carried them.
ENGINE_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}


def parse_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """The engine's logprobs params from `include` and `top_logprobs` (0-20; a positive one asks for them too)."""
    include = get_field(body, "include", (list,), default=[])
    if not all(isinstance(value, str) for value in include):
        raise bad_request("Invalid 'include': expected an array of strings", param="include", code="invalid_type")
    top = get_field(body, "top_logprobs", (int,), minimum=0, maximum=20)
    return {"logprobs": True, "top_logprobs": top or 0} if LOGPROBS_INCLUDE in include or top else {}


@dataclass
class ResponsesRequest:
    """A validated POST /v1/responses body, before the stored conversation is joined in."""

    messages: list[dict[str, Any]]  # this request's input as chat messages
    instructions: str | None
    previous_response_id: str | None
    engine: dict[str, Any]  # ADD fields besides `messages`
    echo: dict[str, Any]  # what the response object repeats of the request
    stream: bool
    store: bool
    input_items: list[dict[str, Any]]  # this request's input as Responses items, for GET …/input_items
    owner: str | None = None  # the caller's key digest (`Caller.client`): only it may read the stored response
    tools: ToolCatalog = field(default_factory=ToolCatalog)  # offered tools' origins (namespaces, custom)


def parse_request(body: dict[str, Any], max_items: int, max_tokens_limit: int | None,
                  media: MediaCollector | None = None, stop_limits: tuple[int, int] = (16, 1024)) -> ResponsesRequest:
    """Checks every field before anything reaches the engine; a bad one is a 400 naming it.

    Image and audio parts are registered with `media` (fetched later, after every check).
    """
    for name, message in UNSUPPORTED.items():
        if body.get(name):
            raise bad_request(message, param=name, code="unsupported_parameter")
    model = get_field(body, "model", (str,))
    instructions = get_field(body, "instructions", (str,))
    previous = get_field(body, "previous_response_id", (str,))
    value = body.get("input")
    if value is None and previous is None:
        raise bad_request("Missing required parameter: 'input'", param="input", code="missing_required_parameter")
    catalog = tools_of(body)
    messages = parse_input(value, max_items, media, catalog) if value is not None else []
    params = parse_sampling(body, *stop_limits) | parse_logprobs(body)
    max_output = get_field(body, "max_output_tokens", (int,), minimum=1, maximum=2**31 - 1)
    if max_output is not None:
        params["max_tokens"] = max_output
    if max_tokens_limit is not None and params.get("max_tokens", 0) > max_tokens_limit:
        name = "max_output_tokens" if max_output is not None else \
            "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise bad_request(f"Invalid value for '{name}': {params['max_tokens']} is greater than this server's "
                          f"limit of {max_tokens_limit}", param=name, code="max_tokens_exceeded")
    tools = catalog.tools or None
    tool_choice = parse_tool_choice(body.get("tool_choice"), catalog)
    parallel = get_field(body, "parallel_tool_calls", (bool,))
    response_format = parse_text_format(body.get("text"))
    effort = parse_reasoning(body.get("reasoning"))
    # The chat route's extensions (chat_template_kwargs, enable_thinking, thinking_budget) work here too.
    kwargs, thinking_budget = chat_reasoning(body, get_field(body, "chat_template_kwargs", (dict,)))
    template_kwargs = dict(kwargs or {})
    if thinking_budget is not None:
        params["thinking_budget"] = thinking_budget
    if effort is not None:
        template_kwargs.setdefault("enable_thinking", effort not in NO_THINKING_EFFORTS)
        template_kwargs.setdefault("reasoning_effort", effort)
    metadata = check_metadata(get_field(body, "metadata", (dict,), default={}))
    truncation = parse_truncation(body.get("truncation"))
    # OpenAI caps calls to its built-in tools with it; this server runs none, so it is checked and echoed only.
    max_tool_calls = get_field(body, "max_tool_calls", (int,), minimum=1)
    engine = {"model": model, "params": params, "tools": tools, "tool_choice": tool_choice,
              "parallel_tool_calls": parallel, "response_format": response_format,
              "chat_template_kwargs": template_kwargs or None,
              "context_overflow": TRUNCATION_MODES[truncation] if truncation else None}
    text = {"format": body["text"]["format"] if response_format else {"type": "text"}, "verbosity": "medium"}
    echo = {
        "object": "response", "background": False, "instructions": instructions,
        "max_output_tokens": max_output, "max_tool_calls": max_tool_calls,
        "parallel_tool_calls": True if parallel is None else parallel, "previous_response_id": previous,
        "reasoning": {"effort": effort, "summary": None}, "service_tier": "default",
        "store": get_field(body, "store", (bool,), default=True), "temperature": params.get("temperature"),
        "text": text, "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "top_p": params.get("top_p"), "top_logprobs": params.get("top_logprobs"),
        "truncation": truncation or "disabled", "user": get_field(body, "user", (str,)),
        "metadata": metadata,
    }
    return ResponsesRequest(messages, instructions, previous, {k: v for k, v in engine.items() if v is not None},
                            echo, get_field(body, "stream", (bool,), default=False), echo["store"],
                            input_item_list(value), tools=catalog)


def packed_size(value: Any) -> int:
    """Bytes of `value` in a frame; integers msgpack cannot carry (past 64 bits) count as too large."""
    try:
        return len(msgpack.packb(value, use_bin_type=True))
    except (OverflowError, ValueError, TypeError):
        return MAX_FRAME_BYTES + 1


def check_frame_size(engine_request: dict[str, Any], echo: dict[str, Any]) -> None:
    """What goes to the engine (the ADD, later the stored record) must fit in one frame.

    The body limit keeps a lone request under the frame limit, but a long stored
    history may not; an integer past 64 bits (in a tool schema, in metadata) cannot
    be sent at all. Both are 400s here rather than a failure after the model ran.
    """
    if packed_size({"request": engine_request, "echo": echo}) > MAX_RECORD_BYTES:
        raise bad_request("The request (with the conversation of its previous responses) is too large to send to "
                          "the engine, or holds an integer outside the 64-bit range", code="request_too_large")


# OpenAI's limits on `metadata`: it is stored with the response, so it is bounded like the rest.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def check_metadata(metadata: dict[str, Any]) -> dict[str, str]:
    """`metadata`: at most 16 string pairs, keys up to 64 and values up to 512 characters (as OpenAI)."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"'metadata' may hold at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
                          param="metadata", code="invalid_value")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"'metadata' keys must be strings of at most {MAX_METADATA_KEY} characters and values "
                              f"strings of at most {MAX_METADATA_VALUE}", param="metadata", code="invalid_value")
    return metadata


def _not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id '{response_id}' not found.", code="response_not_found", param=param)


async def load_record(client: EnginePool, req: falcon.asgi.Request, response_id: str,
                      param: str | None = None) -> dict[str, Any]:
    """The stored record of a response this caller created; 404 for any other (its existence is not told).

    The record lives in the engine that made the response, named in its id (`EnginePool.response_id`);
    `req.context.response_engine` is set to that engine. An id that names no engine (made by a single
    engine) is looked for on each engine in turn; one whose engine is gone is a 404 that says so.
    """
    record, engine = None, client.engine_of_response(response_id)
    if len(response_id) <= MAX_ID_LENGTH:
        if engine and engine not in client.links:
            raise APIError(404, f"{'Previous response' if param else 'Response'} with id '{response_id}' not found: "
                                f"its engine '{engine}' is not behind this front-end.",
                           code="response_not_found", param=param)
        if engine and not client.single and client.state_of(engine) == "unreachable":
            raise APIError(404, f"{'Previous response' if param else 'Response'} with id '{response_id}' is held by "
                                f"engine '{engine}', which is not available.", code="response_not_found", param=param)
        for candidate in [engine] if engine or client.single else client.ids:
            try:
                record = await call_engine(client, CallMethod.RESPONSES_GET, args={"id": response_id},
                                           engine=candidate or None)
            except APIError:
                if client.single or engine:
                    raise
                continue  # an unreachable engine, while looking for an id that names none
            if isinstance(record, dict):
                engine = candidate
                break
    if not isinstance(record, dict) or record.get("owner") != caller_of(req).client:
        raise _not_found(response_id, param)
    req.context.response_engine = engine or None
    return record


class Responses(GenerationRoute):
    """POST /v1/responses: JSON or the Responses event stream."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        collector = MediaCollector.for_request(body, self.settings)
        request = parse_request(body, self.settings.max_messages, self.settings.max_tokens_limit, collector,
                                (self.settings.max_stop_strings, self.settings.max_stop_length))
        request = replace(request, owner=caller_of(req).client)
        if request.tools.ignored:  # hosted tools the engine cannot run: left out, and said so
            resp.set_header("X-Ignored-Tools", ignored_tools_header(request.tools.ignored))
        history: list[dict[str, Any]] = []
        media: list[dict[str, Any]] = []  # the conversation's images and audio, earlier turns' included
        if request.previous_response_id is not None:
            record = await load_record(self.client, req, request.previous_response_id, "previous_response_id")
            req.context.previous_response_id = request.previous_response_id  # routing: back to its engine
            history = list(record.get("messages") or [])
            media = list(record.get("media") or [])
        conversation = name_tool_results(history + request.messages, calls_elsewhere=skips_items(body))
        if not conversation:
            raise bad_request("'input' must contain at least one item", param="input")
        media += await collector.resolve() or []  # fetches http(s) images: after every other check
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        engine_request = {**request.engine, "messages": system + conversation}
        if media:
            engine_request["media"] = media
        check_frame_size(engine_request, request.echo)
        try:
            await serve_generation(
                req, resp, self.client, self.request_timeout, self.metrics, engine_request, "resp",
                request.engine.get("model"), request.stream,
                events=lambda stream, meta, timer: self._events(stream, self._builder(meta, request, stream), timer,
                                                                request, conversation, media),
                complete=lambda stream, meta, timer: self._complete(stream, self._builder(meta, request, stream),
                                                                    timer, request, conversation, media))
        except APIError as exc:
            # The engine names the chat fields it was sent; a Responses client sent these.
            exc.param = ENGINE_PARAMS.get(exc.param or "", exc.param)
            raise

    def _builder(self, meta: dict[str, Any], request: ResponsesRequest, stream: RequestStream) -> ResponseBuilder:
        # With several engines the id names the engine that stores it: a follow-up finds it there.
        response_id = self.client.response_id(meta["id"].split("-", 1)[1], stream.engine_id)
        echo = dict(request.echo)
        if (stream.accepted or {}).get("context_overflow"):  # older items made way for the window
            echo["truncation"] = "auto"
        return ResponseBuilder({"id": response_id, "created_at": meta["created"], "model": meta["model"],
                                **echo}, request.tools.origins)

    async def _store(self, builder: ResponseBuilder, request: ResponsesRequest, conversation: list[dict[str, Any]],
                     media: list[dict[str, Any]], engine: str | None = None) -> None:
        """Hands a finished response to the engine's store; a failure is logged, the answer still goes out.

        The record keeps the conversation's media (their placeholders are in its messages)
        so a later turn sends them again: the engine keeps nothing between requests. A failed
        response is stored too, as OpenAI keeps every response it gave an id (`GET` shows its
        error); a later turn from it resumes from what it had written, if anything.
        """
        if not request.store:
            return
        response = builder.response()
        if (response.get("error") or {}).get("code") in LOST_ENGINE_CODES:
            return  # the engine holding the store is gone or going (SIGTERM): waiting on it held the stream 2 s
        reply = [builder.assistant_message()] if builder.status != "failed" or builder.output else []
        record = {"response": response, "messages": conversation + reply,
                  "input_items": request.input_items, "owner": request.owner}
        if media:
            record["media"] = media
        if packed_size(record) > MAX_RECORD_BYTES:
            log.warning("response %s not stored: too large for one frame to the engine", response["id"])
            return
        try:
            result = await call_engine(self.client, CallMethod.RESPONSES_PUT,
                                       args={"id": response["id"], "record": record}, engine=engine)
        except APIError as exc:
            log.warning("response %s not stored: %s", response["id"], exc.message)
            return
        if not (isinstance(result, dict) and result.get("stored")):
            log.warning("response %s not stored: larger than the engine's response store", response["id"])

    async def _complete(self, stream: RequestStream, builder: ResponseBuilder, timer: TokenTimer,
                        request: ResponsesRequest, conversation: list[dict[str, Any]],
                        media: list[dict[str, Any]]) -> dict[str, Any]:
        async for update in relay(stream, self.request_timeout):
            if update is None:
                continue
            timer.on_update(update)
            builder.feed(update)
        await self._store(builder, request, conversation, media, stream.engine_id)
        return builder.response()

    async def _events(self, stream: RequestStream, builder: ResponseBuilder, timer: TokenTimer,
                      request: ResponsesRequest, conversation: list[dict[str, Any]],
                      media: list[dict[str, Any]]) -> AsyncIterator[SSEvent | None]:
        """The shared SSE body (keep-alives, release on every path) without `[DONE]`, in Responses events.

        The first two events go out through `first`, so the request is released even when
        the client leaves right then; an engine error becomes `error` + `response.failed`.
        """
        created, in_progress = builder.start()

        def render(update: Update) -> list[SSEvent]:
            return [_sse(event) for event in builder.feed(update)]

        inner = self.sse(stream, timer, render, first=_sse(created), done=False)
        try:
            async for event in inner:
                if event is None:
                    yield None
                    continue
                payload = event.json
                if isinstance(payload, dict) and "error" in payload and "type" not in payload:
                    error = payload["error"]
                    failure = builder.fail(APIError(500, error.get("message", "engine error"),
                                                    code=error.get("code"), param=error.get("param")))
                    await self._store(builder, request, conversation, media, stream.engine_id)
                    for failed in failure:
                        yield _sse(failed)
                    continue
                if isinstance(payload, dict) and payload.get("type") in TERMINAL_EVENTS:
                    await self._store(builder, request, conversation, media, stream.engine_id)
                yield event
                if payload is created:
                    yield _sse(in_progress)
        finally:
            await inner.aclose()


def _sse(event: Event) -> SSEvent:
    return SSEvent(event=event["type"], json=event)


async def _replay(events: list[Event]) -> AsyncIterator[SSEvent]:
    for event in events:
        yield _sse(event)


class ResponseById:
    """GET and DELETE /v1/responses/{response_id}, answered from the engine's store."""

    def __init__(self, client: EnginePool):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str) -> None:
        """The stored response: its JSON, or with `stream=true` its events as SSE (`starting_after` resumes)."""
        stream = req.get_param_as_bool("stream", default=False)
        record = await load_record(self.client, req, response_id)
        if req.context.response_engine:
            resp.set_header("X-Engine-Id", req.context.response_engine)
        if not stream:
            resp.media = record.get("response")
            return
        events = replay_events(record.get("response") or {})
        after = starting_after(req.get_param("starting_after"), events)
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-cache")
        resp.sse = _replay(events[after + 1:])

    async def on_get_input_items(self, req: falcon.asgi.Request, resp: falcon.asgi.Response,
                                 response_id: str) -> None:
        """GET /v1/responses/{id}/input_items: the stored request's input items, OpenAI's list shape."""
        order = req.get_param("order", default="desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"Invalid value for 'order': {order!r}; expected 'asc' or 'desc'", param="order")
        limit = req.get_param_as_int("limit", min_value=1, max_value=100, default=20)
        items = list((await load_record(self.client, req, response_id)).get("input_items") or [])
        if order == "desc":
            items.reverse()
        after = req.get_param("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        resp.media = {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                      "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    async def on_post_cancel(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str) -> None:
        """Only background responses can be cancelled, and this server runs none (`background` is refused)."""
        await load_record(self.client, req, response_id)  # an unknown (or another key's) id is a 404 first
        raise bad_request("Only responses created with 'background': true can be cancelled; this server does not "
                          "run background responses", param="response_id", code="not_background")

    async def on_delete(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str) -> None:
        await load_record(self.client, req, response_id)  # only the key that created it may delete it
        result = await call_engine(self.client, CallMethod.RESPONSES_DELETE, args={"id": response_id},
                                   engine=req.context.response_engine)
        if not (isinstance(result, dict) and result.get("deleted")):
            raise _not_found(response_id)
        resp.media = {"id": response_id, "object": "response", "deleted": True}
