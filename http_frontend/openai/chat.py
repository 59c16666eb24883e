"""POST /v1/chat/completions: OpenAI Chat JSON <-> protocol ADD / DELTAS.

The request is read by the shared parsers (`parse_messages`, `parse_sampling`, the
tool and format fields) and served by `serve_generation`; what is chat's own is the
answer: `chat.completion` JSON or `chat.completion.chunk` events.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import falcon.asgi
from falcon.asgi import SSEvent

from http_frontend.engine.client import RequestStream, Update
from http_frontend.parsing.body import get_field, read_json_object
from http_frontend.parsing.generation_fields import (
    hosted_tools,
    ignored_tools_header,
    parse_reasoning,
    parse_response_format,
    parse_tool_choice,
    parse_tools,
)
from http_frontend.parsing.media import MediaCollector
from http_frontend.parsing.messages import check_message_count, parse_messages
from http_frontend.parsing.sampling import check_max_tokens, check_unsupported, parse_logprobs, parse_sampling
from http_frontend.relay.generation import GenerationRoute, relay, serve_generation, usage_object
from http_frontend.relay.tool_calls import ToolCallEvent, ToolCallRelay
from http_frontend.service.metrics import TokenTimer

log = logging.getLogger(__name__)


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An engine tool call in OpenAI's shape (a reply's `message.tool_calls` entry)."""
    return {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


def _tool_call_deltas(events: list[ToolCallEvent]) -> list[dict[str, Any]]:
    """Tool-call events as OpenAI's streamed `tool_calls` entries: the first of a call with its id, type
    and name (and the arguments that came with it), the others with an argument piece."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        if event.kind == "whole":
            deltas.append({"index": event.index, **_tool_call(event.call)})
        elif event.kind == "start":
            deltas.append({"index": event.index, "id": event.call["id"], "type": "function",
                           "function": {"name": event.call["name"], "arguments": ""}})
        elif event.kind == "arguments":
            if deltas and deltas[-1]["index"] == event.index:
                deltas[-1]["function"]["arguments"] += event.text
            else:
                deltas.append({"index": event.index, "function": {"arguments": event.text}})
    return deltas


class ChatCompletions(GenerationRoute):
    """The chat route: validates, submits to the engine, answers JSON or SSE."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        check_message_count(body, self.settings.max_messages)
        media = MediaCollector.for_request(body, self.settings)
        messages = parse_messages(body, media)
        check_unsupported(body, logprobs_supported=True)
        params = {**parse_sampling(body, self.settings.max_stop_strings, self.settings.max_stop_length),
                  **parse_logprobs(body)}
        check_max_tokens(body, params, self.settings.max_tokens_limit)
        model = get_field(body, "model", (str,))
        stream_requested = get_field(body, "stream", (bool,), default=False)
        stream_options = get_field(body, "stream_options", (dict,), default={})
        include_usage = bool(stream_options.get("include_usage"))
        template_kwargs, thinking_budget = parse_reasoning(body, get_field(body, "chat_template_kwargs", (dict,)))
        if thinking_budget is not None:
            params["thinking_budget"] = thinking_budget
        tools = parse_tools(body)
        ignored = hosted_tools(body)
        if ignored:  # left out of the prompt (`parse_tools`), and said so
            log.info("tools the engine cannot run were left out: %s", ", ".join(ignored))
            resp.set_header("X-Ignored-Tools", ignored_tools_header(ignored))
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
            message["tool_calls"] = [_tool_call(call) for call in calls]
        return {
            **meta, "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"index": 0, "message": message,
                         "logprobs": {"content": entries} if logprobs else None,
                         "finish_reason": finish_reason}],
            "usage": usage_object(usage),
        }

    def _events(self, stream: RequestStream, meta: dict[str, Any], include_usage: bool,
                timer: TokenTimer | None = None, logprobs: bool = False) -> AsyncIterator[SSEvent | None]:
        timer = timer or self.metrics.token_timer({})
        tool_relay = ToolCallRelay()

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
            events.extend(chunk({"tool_calls": [delta]}) for delta in _tool_call_deltas(tool_relay.events(update)))
            if update.finish_reason:
                events.append(chunk({}, update.finish_reason))
                if include_usage:
                    events.append(SSEvent(json={**meta, "object": "chat.completion.chunk",
                                                "system_fingerprint": None, "choices": [],
                                                "usage": usage_object(update.usage)}))
            return events

        return self.sse(stream, timer, render, first=chunk({"role": "assistant", "content": ""}))
