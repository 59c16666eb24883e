"""Engine updates -> Anthropic content blocks, stream events and the final message.

One builder serves both answers: the streamed events and the JSON message are
produced by the same code from the same updates, so they cannot disagree.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from falcon.asgi import SSEvent

from http_frontend.engine.client import Update
from http_frontend.relay.tool_calls import ToolCallEvent, ToolCallRelay

log = logging.getLogger(__name__)

FINISH_TO_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# OpenAI-shaped error types/codes (what GenerationRoute.sse emits) -> Anthropic's error types.
_ERROR_TYPES = {"engine_unavailable": "overloaded_error", "engine_restarted": "overloaded_error",
                "engine_shutting_down": "overloaded_error",
                "overloaded": "overloaded_error", "timeout": "timeout_error"}


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments (a JSON string from the engine) as the object Anthropic's `input` is."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except (TypeError, ValueError, RecursionError):  # nested past what json follows: as if not JSON
        parsed = closed_json(arguments) if isinstance(arguments, str) else None
        if parsed is None:
            log.warning("tool call arguments are not JSON, sent as an empty input: %.200r", arguments)
            return {}
    if not isinstance(parsed, dict):
        log.warning("tool call arguments are not a JSON object, sent as an empty input: %.200r", arguments)
        return {}
    return parsed


def closed_json(text: str) -> Any:
    """A JSON text cut short (a call cut by max_tokens), closed where it stopped; None when that fails.

    Anthropic's `input` must be an object even when `stop_reason` is `max_tokens` (a call that
    arrives whole streams this object too; one streamed in pieces gets `closing_suffix`). Best effort: an unfinished
    string value is closed (a half-written escape left out); otherwise the text is cut back
    to the last place a value ended (a comma, or just inside an opened object or array) and
    the open brackets are closed. So fields written in full are kept, a dangling key or a
    half-written number or literal is dropped.
    """
    stack, in_string, cuts = _scan_json(text)
    wholes = [text]
    if in_string:  # close the string; failing that, without a half-written escape (`\\`, `\\u00`)
        wholes = [text + '"', re.sub(r"\\(u[0-9a-fA-F]{0,3})?$", "", text) + '"']
    attempts = [whole.rstrip() + "".join(reversed(stack)) for whole in wholes]
    attempts += [text[:end].rstrip() + closers for end, closers in reversed(cuts[-64:])]
    for attempt in attempts:
        try:
            return json.loads(attempt)
        except (ValueError, RecursionError):
            continue
    return None


def _scan_json(text: str) -> tuple[list[str], bool, list[tuple[int, str]]]:
    """A JSON text's open brackets (their closers, innermost last), whether it ends inside a string, and the
    places a value ended (a comma, or just inside an opened object or array) with the closers open there."""
    stack: list[str] = []
    in_string = escaped = False
    cuts: list[tuple[int, str]] = []
    for position, char in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
            cuts.append((position + 1, "".join(reversed(stack))))
        elif char in "}]" and stack:
            stack.pop()
        elif char == ",":
            cuts.append((position, "".join(reversed(stack))))
    return stack, in_string, cuts


def closing_suffix(text: str) -> str:
    """What closes a JSON text cut inside a string or brackets (`{"a": "b` -> `"}`); "" when whole or hopeless.

    Streamed `input_json_delta` pieces cannot be taken back: a cut call's are closed where they
    stopped when that makes valid JSON, else left as they are (the SDKs read them in partial mode).
    """
    stack, in_string, _ = _scan_json(text)
    suffix = ('"' if in_string else "") + "".join(reversed(stack))
    try:
        json.loads(text + suffix)
    except (ValueError, RecursionError):
        return ""
    return suffix


class BlockBuilder:
    """Grows Anthropic content blocks from merged updates and says, as events, what changed.

    Within one update, thinking comes before text and text before tool calls: the
    order a model produces them in. A tool call's block opens when the engine names
    the call, streams its input as `input_json_delta` pieces while the model writes it,
    and closes when the call is whole (a call that arrives whole does all three at
    once). Whitespace-only text (the newline a template
    puts before a tool call) never becomes a block of its own: Anthropic's API refuses
    such blocks when a client sends the turn back.
    """

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # type of the last block while more of it may come
        self._blank = ""  # whitespace that opens no text block until some text follows it
        self._tool_calls = ToolCallRelay()
        self._tool_blocks: dict[int, int] = {}  # engine call index -> its open tool_use block's index

    def feed(self, update: Update) -> list[dict[str, Any]]:
        events = []
        continuing, starting = self._tool_calls.events_around_text(update)
        for tool_event in continuing:
            events += self._tool_use(tool_event)
        if update.reasoning:
            events += self._grow("thinking", update.reasoning)
        if update.text:
            if self._open != "text" and not (self._blank + update.text).strip():
                self._blank += update.text
            else:
                events += self._grow("text", self._blank + update.text)
                self._blank = ""
        for tool_event in starting:
            events += self._tool_use(tool_event)
        return events

    def finish(self) -> list[dict[str, Any]]:
        return self._close()

    @property
    def has_tool_use(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks)

    def _grow(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events = []
        if self._open != kind:
            events += self._close()
            self._open = kind
            self.blocks.append({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": ""})
            # A copy: the event is serialised later, after the block has grown.
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                           "content_block": dict(self.blocks[-1])})
        self.blocks[-1][kind] += piece
        delta = {"type": f"{kind}_delta", kind: piece}
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        return events

    def _tool_use(self, tool_event: ToolCallEvent) -> list[dict[str, Any]]:
        if tool_event.kind == "whole":
            return self._whole_tool_use(tool_event.call)
        if tool_event.kind == "start":
            events = self._close()
            call = tool_event.call
            self.blocks.append({"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                                "name": call.get("name", ""), "input": {}})
            self._open = "tool_use"
            self._tool_blocks[tool_event.index] = len(self.blocks) - 1
            return events + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                              "content_block": dict(self.blocks[-1])}]
        index = self._tool_blocks.get(tool_event.index)
        if index is None:  # a block closed under it (cannot happen in the engine's order): nothing to add to
            return []
        if tool_event.kind == "arguments":
            return [{"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": tool_event.text}}]
        del self._tool_blocks[tool_event.index]
        self.blocks[index]["input"] = tool_input(tool_event.call.get("arguments"))
        closers = closing_suffix(tool_event.text)  # a cut call: its streamed JSON closed where it stopped
        end = [{"type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": closers}}] if closers else []
        return end + self._close()

    def _whole_tool_use(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A call none of which was streamed: its block opens, gets its input and closes at once."""
        events = self._close()
        block = {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                 "name": call.get("name", ""), "input": tool_input(call.get("arguments"))}
        self.blocks.append(block)
        index = len(self.blocks) - 1
        return events + [
            {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
            {"type": "content_block_delta", "index": index,
             "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
            {"type": "content_block_stop", "index": index},
        ]

    def _close(self) -> list[dict[str, Any]]:
        self._blank = ""
        if self._open is None:
            return []
        self._open, self._tool_blocks = None, {}
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def stop_reason(finish_reason: str | None, stop_sequence: str | None,
                has_tool_use: bool) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the engine's finish reason and matched stop string."""
    if finish_reason is None:
        return None, None
    if stop_sequence and finish_reason == "stop":
        return "stop_sequence", stop_sequence
    if has_tool_use and finish_reason == "stop":
        return "tool_use", None
    return FINISH_TO_STOP_REASON.get(finish_reason, "end_turn"), None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic usage: `input_tokens` excludes cache reads (total input = input + cache read + cache creation)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def engine_usage(raw: dict[str, int] | None) -> dict[str, int]:
    raw = raw or {}
    return usage(raw.get("prompt_tokens", 0), raw.get("completion_tokens", 0), raw.get("cached_tokens", 0))


def message(meta: dict[str, Any], content: list[dict[str, Any]], stop: tuple[str | None, str | None],
            usage_body: dict[str, int]) -> dict[str, Any]:
    return {"id": meta["id"], "type": "message", "role": "assistant", "model": meta["model"], "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_body}


def event(payload: dict[str, Any]) -> SSEvent:
    """Every Anthropic SSE names its type in `event:` and repeats it in the JSON `data`."""
    return SSEvent(event=payload["type"], json=payload)


def error_payload(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped error body (from GenerationRoute.sse) as Anthropic's error event."""
    error = body.get("error") or {}
    kind = _ERROR_TYPES.get(error.get("code") or "")
    if kind is None:
        kind = error.get("type") if error.get("type") in ("invalid_request_error", "rate_limit_error") else "api_error"
    return {"type": "error", "error": {"type": kind, "message": error.get("message", "error")}}


async def anthropic_sse(events: AsyncGenerator[SSEvent | None, None]) -> AsyncIterator[SSEvent]:
    """GenerationRoute.sse's stream in Anthropic's grammar: keep-alives and errors become `ping`/`error` events.

    A `ping` follows `message_start`, as Anthropic sends it. The inner generator is
    closed with this one, so its `finally` releases the request on every path.
    """
    try:
        async for item in events:
            if item is None:
                yield event({"type": "ping"})
            elif item.event is None and isinstance(item.json, dict) and "error" in item.json:
                yield event(error_payload(item.json))
            else:
                yield item
                if item.event == "message_start":
                    yield event({"type": "ping"})
    finally:
        await events.aclose()
