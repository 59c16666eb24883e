"""Engine updates -> Responses output items and the streaming events OpenAI sends for them.

One builder serves both answers: the streaming route sends the events it returns,
the JSON route ignores them and takes `response()`, so both agree item for item.
Items come in the order the model produced them: a reasoning item (thinking
text), a message (answer text), then one function_call item per tool call.
Event order and shapes follow `openai.types.responses` (SDK 3.52): every event has
a `sequence_number` counting from 0; the stream ends with `response.completed`
(or `response.incomplete` when `max_output_tokens` cut it, as OpenAI does) and no
`[DONE]`.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from http_frontend.engine.client import Update
from http_frontend.errors import APIError
from http_frontend.openai.responses_tools import ToolOrigin, custom_input
from http_frontend.relay.tool_calls import ToolCallEvent, ToolCallRelay

log = logging.getLogger(__name__)

Event = dict[str, Any]
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    """The engine's usage in the Responses shape."""
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


class ResponseBuilder:
    """Feeds on merged engine updates; returns the events each one causes."""

    def __init__(self, base: dict[str, Any], origins: dict[str, ToolOrigin] | None = None):
        # `base`: the response object's fixed fields (id, model, echoed request settings).
        self.base = base
        # Offered tool name -> what it is to the client (a namespace's function, a custom tool).
        self.origins = origins or {}
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item receiving text
        self._logprobs: list[dict[str, Any]] = []  # answer tokens' logprobs not yet sent with their text
        self.text = ""
        self.reasoning = ""
        self.calls: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.completed_at: float | None = None
        self._tool_calls = ToolCallRelay()
        self._streaming: dict[int, dict[str, Any]] = {}  # call index -> its open item

    # -- events -------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def start(self) -> list[Event]:
        """`response.created` and `response.in_progress`, sent before any output."""
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, update: Update) -> list[Event]:
        events: list[Event] = []
        continuing, starting = self._tool_calls.events_around_text(update)
        for tool_event in continuing:
            events += self._tool_event(tool_event)
        if update.reasoning:
            events += self._append("reasoning", update.reasoning)
        # An answer token's logprobs go with its output_text (a held-back token's wait for the text it
        # becomes); a thinking token's and a tool call's own tokens' have no output_text to go with.
        if update.tool_parts:
            self._logprobs = []
        elif update.logprobs and (update.text or not update.reasoning):
            self._logprobs += update.logprobs
        if update.text:
            events += self._append("message", update.text)
        for tool_event in starting:
            events += self._tool_event(tool_event)
        if update.finish_reason:
            events += self._finish(update.finish_reason, update.usage)
        return events

    def fail(self, error: APIError) -> list[Event]:
        """An engine error mid-stream: OpenAI's `error` event, then `response.failed`."""
        self.status = "failed"
        self.error = {"code": error.code or "server_error", "message": error.message}
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=self.response())]

    # -- items ----------------------------------------------------------------------
    def _append(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._open_item(kind)
        item, index = self._open, len(self.output) - 1
        if kind == "reasoning":
            self.reasoning += text
            item["_text"] += text
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text))
        else:
            self.text += text
            item["_text"] += text
            logprobs, self._logprobs = self._logprobs, []
            item["_logprobs"] += logprobs
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text, logprobs=logprobs))
        return events

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "content": [],
                    "role": "assistant"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=dict(item)),
                  self._event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=part)]
        item["_text"], item["_logprobs"] = "", []
        self._open = item
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        """Finishes the open reasoning/message item with its `.done` events."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        text, logprobs = item.pop("_text"), item.pop("_logprobs")
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text)
        else:
            logprobs, self._logprobs = logprobs + self._logprobs, []  # a last held-back token's, if any
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            done = self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text, logprobs=logprobs)
        item["content"] = [part]
        item["status"] = status
        return [done,
                self._event("response.content_part.done", item_id=item["id"], output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _tool_event(self, tool_event: ToolCallEvent) -> list[Event]:
        """A call's item opens when the engine names it, its arguments stream (`function_call_arguments.delta`;
        a custom tool's `input` decoded from its `{"input": "…` arguments, `custom_tool_call_input.delta`), and
        it is done when the call is whole."""
        call, index = tool_event.call, tool_event.index
        if tool_event.kind == "whole":
            return self._call(call)
        if tool_event.kind == "start":
            origin = self.origins.get(call.get("name", ""))
            custom = origin is not None and origin.kind == "custom"
            item, events = self._open_custom(call, origin) if custom else self._open_call(call)
            self._streaming[index] = item
            return events
        item = self._streaming.get(index)
        if item is None:  # cannot happen in the engine's order
            return self._call(call) if tool_event.kind == "done" else []
        custom = item["type"] == "custom_tool_call"
        if tool_event.kind == "arguments":
            if custom:
                return self._custom_piece(item, tool_event.text)
            item["arguments"] += tool_event.text
            return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=self.output.index(item), delta=tool_event.text)]
        del self._streaming[index]
        return self._end_custom(item, call) if custom else self._end_call(item, call)

    def _call(self, call: dict[str, Any]) -> list[Event]:
        """A complete tool call from the engine: its item, arguments in one delta, and its `.done`s."""
        arguments = call.get("arguments") or ""
        origin = self.origins.get(call.get("name", ""))
        if origin is not None and origin.kind == "custom":
            return self._close() + self._custom_call(call, origin, arguments)
        item, events = self._open_call(call)
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.output.index(item), delta=arguments))
        return events + self._end_call(item, call)

    def _open_call(self, call: dict[str, Any]) -> tuple[dict[str, Any], list[Event]]:
        """A function_call item for the call the engine named, and its `output_item.added`."""
        events = self._close()
        offered = call.get("name", "")
        origin = self.origins.get(offered)
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": call.get("id") or new_id("call"), "name": origin.name if origin else offered}
        if origin is not None and origin.namespace:
            item["namespace"] = origin.namespace  # Codex runs {"name", "namespace"}, not a joined name
        item["_offered"] = offered
        self.output.append(item)
        self.calls.append(item)
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=_public(item)))
        return item, events

    def _end_call(self, item: dict[str, Any], call: dict[str, Any]) -> list[Event]:
        """The call is whole: `function_call_arguments.done` and `output_item.done`."""
        index = self.output.index(item)
        item["arguments"] = call.get("arguments") or ""
        item["status"] = "incomplete" if call.get("partial") else "completed"  # cut by max_output_tokens
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=_public(item))]

    def _custom_call(self, call: dict[str, Any], origin: ToolOrigin, arguments: str) -> list[Event]:
        """A custom tool's call: a `custom_tool_call` item whose `input` is the raw text, with its events."""
        item, events = self._open_custom(call, origin)
        return events + self._end_custom(item, call)

    def _open_custom(self, call: dict[str, Any], origin: ToolOrigin) -> tuple[dict[str, Any], list[Event]]:
        events = self._close()
        item = {"id": new_id("ctc"), "type": "custom_tool_call", "status": "in_progress", "input": "",
                "call_id": call.get("id") or new_id("call"), "name": origin.name}
        if origin.namespace:
            item["namespace"] = origin.namespace
        item["_offered"], item["_arguments"] = call.get("name", ""), ""
        self.output.append(item)
        self.calls.append(item)
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=_public(item)))
        return item, events

    def _custom_piece(self, item: dict[str, Any], piece: str) -> list[Event]:
        """The next piece of a custom call's `{"input": "…` arguments: the text it adds to `input`, decoded."""
        item["_arguments"] += piece
        if not _INPUT_KEY.match(item["_arguments"]):
            return []  # not yet (or not) the one-string shape: its input is sent when the call is whole
        text = _cut_input(item["_arguments"])
        if len(text) <= len(item["input"]) or not text.startswith(item["input"]):
            return []
        delta, item["input"] = text[len(item["input"]):], text
        return [self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                            output_index=self.output.index(item), delta=delta)]

    def _end_custom(self, item: dict[str, Any], call: dict[str, Any]) -> list[Event]:
        arguments = call.get("arguments") or ""
        text = _cut_input(arguments) if call.get("partial") else custom_input(arguments)
        index, sent = self.output.index(item), item["input"]
        events = []
        if text.startswith(sent) and (len(text) > len(sent) or not sent):
            events.append(self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                                      output_index=index, delta=text[len(sent):]))
        elif not text.startswith(sent):
            log.warning("custom tool call %s: its input does not extend what was streamed of it", item["call_id"])
        item["input"], item["_arguments"] = text, arguments
        item["status"] = "incomplete" if call.get("partial") else "completed"
        return events + [self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                     input=text),
                         self._event("response.output_item.done", output_index=index, item=_public(item))]

    def _finish(self, finish_reason: str, usage: dict[str, int] | None) -> list[Event]:
        cut = finish_reason == "length"
        events = self._close("incomplete" if cut else "completed")
        if not self.output and not cut:
            # The model ended at once: still one (empty) assistant message, as OpenAI answers. One cut
            # by max_output_tokens before anything whole (a forced call before its name) has no item.
            events += self._open_item("message")
            events += self._close("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        self.usage = response_usage(usage)
        self.completed_at = time.time()
        events.append(self._event(f"response.{self.status}", response=self.response()))
        return events

    # -- the response object -----------------------------------------------------------
    def response(self) -> dict[str, Any]:
        finished = self.status in ("completed", "incomplete", "failed")
        items = [{k: v for k, v in item.items() if not k.startswith("_")} for item in self.output] if finished \
            else []
        return {**self.base, "status": self.status, "output": items, "usage": self.usage, "error": self.error,
                "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
                "completed_at": self.completed_at if self.status == "completed" else None}

    def assistant_message(self) -> dict[str, Any]:
        """This response's output as the chat message a later turn resumes from."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                      "function": {"name": c["_offered"],
                                                   "arguments": c.get("_arguments", c.get("arguments", ""))}}
                                     for c in self.calls]
        return message


_INPUT_KEY = re.compile(r'\s*\{\s*"input"\s*:\s*"')


def _cut_input(arguments: str) -> str:
    """A custom call cut by max_output_tokens: the `input` string as far as it got, not its JSON wrapping.

    The engine's partial arguments are the prefix `{"input": "…` (`partial_call`); an
    escape cut in half (`\\u00`) is left out rather than mis-decoded.
    """
    start = _INPUT_KEY.match(arguments)
    if start is None:  # cut before the string began: nothing of it yet; another shape: as written
        return "" if '{"input":"'.startswith(re.sub(r"\s", "", arguments)) else custom_input(arguments)
    body = arguments[start.end():]
    for end in range(len(body), max(len(body) - 6, 0) - 1, -1):
        try:
            return json.JSONDecoder().raw_decode('"' + body[:end] + '"')[0]
        except ValueError:
            continue
    return body


def _public(item: dict[str, Any]) -> dict[str, Any]:
    """An item as clients see it: without the builder's own `_` fields."""
    return {k: v for k, v in item.items() if not k.startswith("_")}
