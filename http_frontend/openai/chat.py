"""POST /v1/chat/completions: OpenAI Chat JSON <-> protocol ADD / DELTAS."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import falcon.asgi
from falcon.asgi import SSEvent

from http_frontend.relay.choices import MAX_CHOICES, choice_requests, merge_event_streams, merge_results
from http_frontend.relay.context_overflow import report_context_overflow
from http_frontend.middleware.disconnect import disconnected_event
from http_frontend.engine.client import EngineClient, EngineError, EngineUnavailable, RequestStream, Update
from http_frontend.errors import APIError, bad_request
from http_frontend.parsing.generation_fields import parse_reasoning, parse_response_format, parse_tool_choice, parse_tools
from http_frontend.parsing.media import AUDIO_PART_TYPES, IMAGE_PART_TYPES, MediaCollector
from http_frontend.service.metrics import RID_KEY, FrontendMetrics, TokenTimer
from http_frontend.settings import FrontendSettings
from http_frontend.parsing.body import get_field, read_json_object

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOP_STRINGS = 16
KEEPALIVE_SECONDS = 1.0
MEDIA_PART_TYPES = IMAGE_PART_TYPES + AUDIO_PART_TYPES

# Fields this server does not implement yet: refused with a 400 rather than silently ignored.
UNSUPPORTED = {
    "functions": "The deprecated 'functions' field is not supported; use 'tools'",
    "function_call": "The deprecated 'function_call' field is not supported; use 'tool_choice'",
    "audio": "Audio output is not supported",
}


def _message_text(message: dict[str, Any], index: int, media: MediaCollector | None = None) -> str | None:
    """Flattens OpenAI content (string or typed parts) into the text a chat template takes.

    Image and audio parts become placeholders in the text, their bytes entries of `media`
    (http_frontend/parsing/media.py); without a collector (routes that take no media) they are refused.
    """
    content = message.get("content")
    param = f"messages.[{index}].content"
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"Invalid type for '{param}': expected a string or an array of content parts",
                          param=param, code="invalid_type")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"Invalid content part in '{param}'", param=param, code="invalid_type")
        if part["type"] in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise bad_request(f"A text part in '{param}' needs a string 'text'", param=param,
                                  code="invalid_type")
            texts.append(part["text"])
        elif media is not None and part["type"] in MEDIA_PART_TYPES:
            texts.append(media.add_part(part, param, message.get("role", "")))
        else:
            raise bad_request(f"Content parts of type '{part['type']}' are not supported here",
                              param=param, code="unsupported_content")
    return "".join(texts)


def parse_messages(body: dict[str, Any], media: MediaCollector | None = None) -> list[dict[str, Any]]:
    messages = get_field(body, "messages", (list,), required=True)
    if not messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"Invalid type for 'messages.[{index}]': expected an object",
                              param=f"messages.[{index}]", code="invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"Invalid value for 'messages.[{index}].role': {role!r}; expected one of "
                              f"{sorted(ROLES)}", param=f"messages.[{index}].role")
        text = _message_text(message, index, media)
        entry = {"role": "system" if role == "developer" else role, "content": text or ""}
        entry.update(_tool_fields(message, index, role))
        parsed.append(entry)
    return parsed


def _tool_fields(message: dict[str, Any], index: int, role: str) -> dict[str, Any]:
    """An assistant turn's `tool_calls` (and reasoning) and a tool result's `tool_call_id`, checked."""
    fields: dict[str, Any] = {}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            param = f"messages.[{index}].tool_calls"
            if not isinstance(calls, list):
                raise bad_request(f"Invalid type for '{param}': expected an array", param=param, code="invalid_type")
            checked = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise bad_request(f"Invalid '{param}': each call needs a 'function' with a string 'name'",
                                      param=param, code="invalid_type")
                arguments = function.get("arguments", "{}")
                if not isinstance(arguments, (str, dict)):
                    raise bad_request(f"Invalid '{param}': 'arguments' must be a JSON string", param=param,
                                      code="invalid_type")
                checked.append({"id": str(call.get("id") or ""), "type": "function",
                                "function": {"name": function["name"], "arguments": arguments}})
            if checked:
                fields["tool_calls"] = checked
        for key in ("reasoning_content", "reasoning"):
            if isinstance(message.get(key), str) and message[key]:
                fields["reasoning_content"] = message[key]
                break
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"Invalid type for 'messages.[{index}].tool_call_id': expected a string",
                              param=f"messages.[{index}].tool_call_id", code="invalid_type")
        if call_id:
            fields["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        fields["name"] = message["name"]
    return fields


def parse_stop(body: dict[str, Any]) -> list[str] | None:
    stop = get_field(body, "stop", (str, list))
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
    return [s for s in stops if s]


def parse_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """Sampling and limit fields shared by the generation routes; omitted ones stay unset."""
    max_tokens = get_field(body, "max_completion_tokens", (int,), minimum=1)
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", (int,), minimum=1)
    top_k = get_field(body, "top_k", (int,), minimum=-1)
    params = {
        "max_tokens": max_tokens,
        "temperature": get_field(body, "temperature", (float,), minimum=0, maximum=2),
        "top_p": get_field(body, "top_p", (float,), minimum=0, maximum=1),
        "top_k": 0 if top_k == -1 else top_k,
        "min_p": get_field(body, "min_p", (float,), minimum=0, maximum=1),
        "repetition_penalty": get_field(body, "repetition_penalty", (float,), minimum=0.01),
        "seed": get_field(body, "seed", (int,)),
        "stop": parse_stop(body),
        "ignore_eos": get_field(body, "ignore_eos", (bool,)),
    }
    for name in ("presence_penalty", "frequency_penalty"):
        params[name] = get_field(body, name, (float,), minimum=-2, maximum=2)
    params["logit_bias"] = parse_logit_bias(body)
    return {k: v for k, v in params.items() if v is not None}


def parse_logit_bias(body: dict[str, Any]) -> dict[str, float] | None:
    """OpenAI's {"token id": bias}: ids as strings (msgpack map keys), biases in [-100, 100]."""
    bias = get_field(body, "logit_bias", (dict,))
    if not bias:
        return None
    checked = {}
    for key, value in bias.items():
        if not str(key).lstrip("-").isdigit():
            raise bad_request(f"Invalid key in 'logit_bias': {key!r} is not a token id", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"Invalid value in 'logit_bias' for {key}: expected a number in [-100, 100]",
                              param="logit_bias")
        checked[str(int(key))] = float(value)
    return checked


def parse_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """Chat's `logprobs` (bool) and `top_logprobs` (0-20, only with logprobs)."""
    wanted = get_field(body, "logprobs", (bool,), default=False)
    top = get_field(body, "top_logprobs", (int,), minimum=0, maximum=20)
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    return {"logprobs": True, "top_logprobs": top or 0} if wanted else {}


def check_unsupported(body: dict[str, Any], logprobs_supported: bool = False) -> None:
    for name, message in UNSUPPORTED.items():
        if body.get(name):
            raise bad_request(message, param=name, code="unsupported_parameter")
    get_field(body, "n", (int,), minimum=1, maximum=MAX_CHOICES)
    if not logprobs_supported and body.get("logprobs"):
        raise bad_request("'logprobs' is not supported yet", param="logprobs", code="unsupported_parameter")


def check_message_count(body: dict[str, Any], limit: int) -> None:
    """Before parsing: a huge message list is refused without walking it."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limit:
        raise bad_request(f"Invalid 'messages': array too long. Expected an array with maximum length {limit}, "
                          f"but got an array with length {len(messages)} instead.", param="messages",
                          code="array_above_max_length")


def check_max_tokens(body: dict[str, Any], params: dict[str, Any], limit: int | None) -> None:
    """The operator's ceiling on `max_tokens` (a request that omits it gets the engine's default)."""
    if limit is None or params.get("max_tokens", 0) <= limit:
        return
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    raise bad_request(f"Invalid value for '{name}': {params['max_tokens']} is greater than this server's limit "
                      f"of {limit}", param=name, code="max_tokens_exceeded")


def _tool_call(call: dict[str, Any], with_index: bool = True) -> dict[str, Any]:
    """An engine tool call in OpenAI's shape; a streamed call arrives whole, in one delta."""
    rendered = {"id": call["id"], "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]}}
    return {"index": call["index"], **rendered} if with_index else rendered


def _usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
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


class ChatCompletions(GenerationRoute):
    """The chat route: validates, submits to the engine, answers JSON or SSE."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        check_message_count(body, self.settings.max_messages)
        media = MediaCollector.for_request(body, self.settings)
        messages = parse_messages(body, media)
        check_unsupported(body, logprobs_supported=True)
        params = {**parse_sampling(body), **parse_logprobs(body)}
        check_max_tokens(body, params, self.settings.max_tokens_limit)
        model = get_field(body, "model", (str,))
        stream_requested = get_field(body, "stream", (bool,), default=False)
        stream_options = get_field(body, "stream_options", (dict,), default={})
        include_usage = bool(stream_options.get("include_usage"))
        template_kwargs, thinking_budget = parse_reasoning(body, get_field(body, "chat_template_kwargs", (dict,)))
        if thinking_budget is not None:
            params["thinking_budget"] = thinking_budget
        tools = parse_tools(body)
        engine_request = {"model": model, "messages": messages, "params": params,
                          "chat_template_kwargs": template_kwargs, "tools": tools,
                          "tool_choice": parse_tool_choice(body, tools),
                          "parallel_tool_calls": get_field(body, "parallel_tool_calls", (bool,)),
                          "response_format": parse_response_format(body),
                          # LoRA adapter: a registered name or a directory under --model-dir (mlx_vlm.server's field)
                          "adapter": get_field(body, "adapter_path", (str,)) or None}
        engine_request["media"] = await media.resolve()  # fetches http(s) images: after every other check

        logprobs = bool(params.get("logprobs"))
        await serve_generation(
            req, resp, self.client, self.request_timeout, self.metrics,
            {key: value for key, value in engine_request.items() if value is not None},
            "chatcmpl", model, stream_requested,
            events=lambda stream, meta, timer: self._events(stream, meta, include_usage, timer, logprobs),
            complete=lambda stream, meta, timer: self._complete(stream, meta, timer, logprobs),
            n=get_field(body, "n", (int,), default=1), include_usage=include_usage)

    async def _complete(self, stream: RequestStream, meta: dict[str, Any],
                        timer: TokenTimer | None = None, logprobs: bool = False) -> dict[str, Any]:
        timer = timer or self.metrics.token_timer({})
        text, reasoning, calls, finish_reason, usage, entries = [], [], [], None, None, []
        async for update in relay(stream, self.request_timeout):
            if update is None:
                continue
            timer.on_update(update)
            text.append(update.text)
            reasoning.append(update.reasoning)
            calls.extend(update.tool_calls)
            entries.extend(update.logprobs)
            finish_reason, usage = update.finish_reason or finish_reason, update.usage or usage
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
        if any(reasoning):
            message["reasoning_content"] = message["reasoning"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = [_tool_call(call, with_index=False) for call in calls]
        return {
            **meta, "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"index": 0, "message": message,
                         "logprobs": {"content": entries} if logprobs else None,
                         "finish_reason": finish_reason}],
            "usage": _usage(usage),
        }

    def _events(self, stream: RequestStream, meta: dict[str, Any], include_usage: bool,
                timer: TokenTimer | None = None, logprobs: bool = False) -> AsyncIterator[SSEvent | None]:
        timer = timer or self.metrics.token_timer({})

        def chunk(delta: dict[str, Any], finish_reason: str | None = None,
                  entries: list[dict[str, Any]] | None = None) -> SSEvent:
            payload = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None,
                       "choices": [{"index": 0, "delta": delta,
                                    "logprobs": {"content": entries} if logprobs and entries else None,
                                    "finish_reason": finish_reason}]}
            if include_usage:
                payload["usage"] = None
            return SSEvent(json=payload)

        def render(update: Update) -> list[SSEvent]:
            events = []
            if update.reasoning:
                events.append(chunk({"reasoning_content": update.reasoning, "reasoning": update.reasoning}))
            if update.text or update.logprobs:
                events.append(chunk({"content": update.text}, entries=update.logprobs))
            if update.tool_calls:
                events.append(chunk({"tool_calls": [_tool_call(call) for call in update.tool_calls]}))
            if update.finish_reason:
                events.append(chunk({}, update.finish_reason))
                if include_usage:
                    events.append(SSEvent(json={**meta, "object": "chat.completion.chunk",
                                                "system_fingerprint": None, "choices": [],
                                                "usage": _usage(update.usage)}))
            return events

        return self.sse(stream, timer, render, first=chunk({"role": "assistant", "content": ""}))

async def serve_generation(
        req: falcon.asgi.Request, resp: falcon.asgi.Response, client: EngineClient, request_timeout: float,
        metrics: FrontendMetrics, engine_request: dict[str, Any], id_prefix: str, model: str | None,
        stream_requested: bool,
        events: Callable[[RequestStream, dict[str, Any], TokenTimer], AsyncIterator[SSEvent | None]],
        complete: Callable[[RequestStream, dict[str, Any], TokenTimer], Awaitable[dict[str, Any]]],
        n: int = 1, include_usage: bool = False) -> None:
    """Submit, wait for ACCEPTED, then answer SSE (`events`) or JSON (`complete`).

    Shared by every generation route. With `n` > 1 the n engine requests' answers
    are merged into one (http_frontend/relay/choices.py). Each request is released
    (ABORTed unless it finished) on every path: here for JSON answers and refusals,
    by `events`' own `finally` once the SSE generator has been handed to falcon.
    """
    streams: list[RequestStream] = []
    handed_over, reason = False, "request_ended"
    try:
        for body in choice_requests(engine_request, n):
            streams.append(await submit_or_503(client, body))
        req.scope[RID_KEY] = streams[0].rid  # for the access line: the engine logs the same rid
        resp.set_header("X-Request-Id", streams[0].rid)
        timer = metrics.token_timer(req.scope)
        # A client that leaves while its request waits in the engine's queue aborts it too.
        accepted = [await until_disconnect(req, wait_accepted(stream, request_timeout)) for stream in streams]
        meta = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": accepted[0].get("model") or model}
        if stream_requested:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            bodies = [events(stream, meta, timer) for stream in streams]
            resp.sse = bodies[0] if n == 1 else merge_event_streams(bodies, include_usage)
            handed_over = True
        else:
            async def complete_all() -> list[dict[str, Any]]:
                # A coroutine, not a bare gather future: cancelling its task on disconnect cancels every
                # choice cleanly (a cancelled gather future would log "exception was never retrieved").
                return list(await asyncio.gather(*(complete(s, meta, timer) for s in streams)))

            results = await until_disconnect(req, complete_all())
            resp.media = results[0] if n == 1 else merge_results(results)
        report_context_overflow(resp, accepted[0])  # header, and usage.context_overflow in JSON answers
    except APIError as exc:
        if exc.code == "client_disconnected":
            reason = exc.code
        raise
    finally:
        if not handed_over:
            for stream in streams:
                client.release(stream, reason)


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


async def submit_or_503(client: EngineClient, request: dict[str, Any]) -> RequestStream:
    try:
        return await client.submit(request)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "1"}) from None


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
