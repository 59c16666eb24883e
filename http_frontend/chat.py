"""POST /v1/chat/completions: OpenAI Chat JSON <-> protocol ADD / DELTAS."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import falcon.asgi
from falcon.asgi import SSEvent

from http_frontend.disconnect import disconnected_event
from http_frontend.engine_client import EngineClient, EngineError, EngineUnavailable, RequestStream, Update
from http_frontend.errors import APIError, bad_request
from http_frontend.metrics import RID_KEY, FrontendMetrics, TokenTimer
from http_frontend.settings import FrontendSettings
from http_frontend.validation import get_field, read_json_object

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOP_STRINGS = 16
KEEPALIVE_SECONDS = 1.0

# Fields this server does not implement yet: refused with a 400 rather than silently ignored.
UNSUPPORTED = {
    "tools": "Tool calling is not supported yet",
    "functions": "Function calling is not supported yet",
    "audio": "Audio output is not supported",
}


def _message_text(message: dict[str, Any], index: int) -> str | None:
    """Flattens OpenAI content (string or typed parts) into the text a chat template takes."""
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
        else:
            raise bad_request(f"Content parts of type '{part['type']}' are not supported by this model",
                              param=param, code="unsupported_content")
    return "".join(texts)


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = get_field(body, "messages", (list,), required=True)
    if not messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"Invalid type for 'messages.[{index}]': expected an object",
                              param=f"messages.[{index}]", code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"Invalid value for 'messages.[{index}].role': {role!r}; expected one of "
                              f"{sorted(ROLES)}", param=f"messages.[{index}].role")
        text = _message_text(message, index)
        parsed.append({"role": "system" if role == "developer" else role, "content": text or ""})
    return parsed


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
    n = get_field(body, "n", (int,), default=1)
    if n != 1:
        raise bad_request("Only n=1 is supported", param="n", code="unsupported_parameter")
    if not logprobs_supported and body.get("logprobs"):
        raise bad_request("'logprobs' is not supported yet", param="logprobs", code="unsupported_parameter")
    response_format = get_field(body, "response_format", (dict,))
    if response_format is not None and response_format.get("type", "text") != "text":
        raise bad_request(f"response_format type {response_format.get('type')!r} is not supported yet",
                          param="response_format", code="unsupported_parameter")


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


def _usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)}}


class GenerationRoute:
    """What every generation route holds: the engine client, limits and metrics."""

    def __init__(self, client: EngineClient, request_timeout: float, *, settings: FrontendSettings | None = None,
                 metrics: FrontendMetrics | None = None):
        self.client = client
        self.request_timeout = request_timeout
        self.settings = settings or FrontendSettings()
        self.metrics = metrics or FrontendMetrics(client)

    async def sse(self, stream: RequestStream, timer: TokenTimer, render: Callable[[Update], list[SSEvent]],
                  first: SSEvent | None = None) -> AsyncIterator[SSEvent | None]:
        """The SSE body of a generation route: `render` turns each merged update into events.

        Keep-alive comments while idle (a gone client is noticed within a second), an
        error event for engine errors, `[DONE]` last, and the request released on every
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
        yield SSEvent(data=b"[DONE]")


class ChatCompletions(GenerationRoute):
    """The chat route: validates, submits to the engine, answers JSON or SSE."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        check_message_count(body, self.settings.max_messages)
        messages = parse_messages(body)
        check_unsupported(body, logprobs_supported=True)
        params = {**parse_sampling(body), **parse_logprobs(body)}
        check_max_tokens(body, params, self.settings.max_tokens_limit)
        model = get_field(body, "model", (str,))
        stream_requested = get_field(body, "stream", (bool,), default=False)
        stream_options = get_field(body, "stream_options", (dict,), default={})
        include_usage = bool(stream_options.get("include_usage"))
        template_kwargs = get_field(body, "chat_template_kwargs", (dict,))

        logprobs = bool(params.get("logprobs"))
        await serve_generation(
            req, resp, self.client, self.request_timeout, self.metrics,
            {"model": model, "messages": messages, "params": params, "chat_template_kwargs": template_kwargs},
            "chatcmpl", model, stream_requested,
            events=lambda stream, meta, timer: self._events(stream, meta, include_usage, timer, logprobs),
            complete=lambda stream, meta, timer: self._complete(stream, meta, timer, logprobs))

    async def _complete(self, stream: RequestStream, meta: dict[str, Any],
                        timer: TokenTimer | None = None, logprobs: bool = False) -> dict[str, Any]:
        timer = timer or self.metrics.token_timer({})
        text, finish_reason, usage, entries = [], None, None, []
        async for update in relay(stream, self.request_timeout):
            if update is None:
                continue
            timer.on_update(update)
            text.append(update.text)
            entries.extend(update.logprobs)
            finish_reason, usage = update.finish_reason or finish_reason, update.usage or usage
        return {
            **meta, "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
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
            if update.text or update.logprobs:
                events.append(chunk({"content": update.text}, entries=update.logprobs))
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
        complete: Callable[[RequestStream, dict[str, Any], TokenTimer], Awaitable[dict[str, Any]]]) -> None:
    """Submit, wait for ACCEPTED, then answer SSE (`events`) or JSON (`complete`).

    Shared by every generation route. The request is released (ABORTed unless it
    finished) on every path: here for JSON answers and refusals, by `events`' own
    `finally` once the SSE generator has been handed to falcon.
    """
    stream = await submit_or_503(client, engine_request)
    req.scope[RID_KEY] = stream.rid  # for the access line: the engine logs the same rid
    resp.set_header("X-Request-Id", stream.rid)
    timer = metrics.token_timer(req.scope)
    handed_over, reason = False, "request_ended"
    try:
        # A client that leaves while its request waits in the engine's queue aborts it too.
        accepted = await until_disconnect(req, wait_accepted(stream, request_timeout))
        meta = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": accepted.get("model") or model}
        if stream_requested:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.sse = events(stream, meta, timer)
            handed_over = True
        else:
            resp.media = await until_disconnect(req, complete(stream, meta, timer))
    except APIError as exc:
        if exc.code == "client_disconnected":
            reason = exc.code
        raise
    finally:
        if not handed_over:
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
