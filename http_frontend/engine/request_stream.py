"""One engine request as the front-end sees it: ACCEPTED, merged deltas, or an error.

The reader task (`EngineClient`) feeds it; the HTTP handler reads it. Pending deltas merge
into one `Update`, so a slow HTTP client costs memory bounded by its own output.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from http_frontend.engine.frames import delta_bytes

# What one more queued `Update` costs beyond its text (~740 bytes measured): counted against the slow-client cap,
# so output alternating text and tool calls cannot hold hundreds of times the cap in near-empty updates.
UPDATE_BYTES = 512


class EngineUnavailable(Exception):
    """The engine cannot be reached (dead, restarting, or never started)."""


class EngineError(Exception):
    """The engine answered a request with an ERROR frame."""

    def __init__(self, body: dict[str, Any]):
        super().__init__(body.get("message", "engine error"))
        self.body = body


@dataclass
class Update:
    """Everything a request produced since the consumer last looked, merged."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # In the engine's order: ("piece", {"index", "arguments"[, "id", "name"]}) of a call being written and
    # ("call", whole call); what `relay.tool_calls.ToolCallRelay` turns into a client's tool-call events.
    tool_parts: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # The prompt tokens' own entries (a request with `prompt_logprobs`), in order; they come before any text.
    prompt_logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    stop_sequence: str | None = None  # the stop string that ended the request, if one did

    def __post_init__(self) -> None:
        if self.tool_calls and not self.tool_parts:  # built with whole calls only: they are its parts
            self.tool_parts = [("call", call) for call in self.tool_calls]


class RequestStream:
    """Collector for one request: ACCEPTED, merged deltas, or an error."""

    def __init__(self, rid: str, max_pending_bytes: int | None = None):
        self.rid = rid
        self.engine_id: str | None = None  # set by `EnginePool.submit`: the engine that runs it
        self.prompt_index = 0  # which of a request's prompts it answers (`serve_generation`: /v1/completions batches)
        self.passed_over: frozenset[str] = frozenset()  # engines `EnginePool.submit` found unable to take it
        self.accepted: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.finished = False
        self.max_pending_bytes = max_pending_bytes  # None: unbounded
        self.pending_bytes = 0  # estimated (`delta_bytes`) size of the updates not yet taken
        self._pending = Update()
        self._pending_bytes = 0  # of `_pending` alone
        self._ready: deque[tuple[Update, int]] = deque()  # closed updates before `_pending`, with their sizes
        self._has_news = asyncio.Event()

    @property
    def over_limit(self) -> bool:
        """True when the consumer has left more output unread than `max_pending_bytes`."""
        return self.max_pending_bytes is not None and self.pending_bytes > self.max_pending_bytes

    # -- fed by the reader -------------------------------------------------------
    def on_accepted(self, body: dict[str, Any]) -> None:
        self.accepted = body
        self._has_news.set()

    def on_deltas(self, item: dict[str, Any]) -> None:
        if _starts_new_update(self._pending, item):
            self._ready.append((self._pending, self._pending_bytes))
            self._pending, self._pending_bytes = Update(), UPDATE_BYTES
            self.pending_bytes += UPDATE_BYTES
        pending = self._pending
        size = delta_bytes(item)
        self.pending_bytes += size
        self._pending_bytes += size
        pending.text += item.get("text") or ""
        pending.reasoning += item.get("reasoning") or ""
        pending.tool_calls.extend(item.get("tool_calls") or ())
        _add_tool_parts(pending.tool_parts, item)
        pending.token_ids.extend(item.get("token_ids") or ())
        pending.logprobs.extend(item.get("logprobs") or ())
        pending.prompt_logprobs.extend(item.get("prompt_logprobs") or ())
        if item.get("finish_reason"):
            pending.finish_reason = item["finish_reason"]
            pending.usage = item.get("usage")
            pending.stop_sequence = item.get("stop_sequence")
            self.finished = True
        self._has_news.set()

    def on_error(self, body: dict[str, Any]) -> None:
        self.error = body
        self.finished = True
        self._pending, self._pending_bytes, self.pending_bytes = Update(), 0, 0  # never delivered: free it now
        self._ready.clear()
        self._has_news.set()

    # -- read by the HTTP handler -----------------------------------------------------
    async def wait_accepted(self, timeout: float) -> dict[str, Any]:
        """The ACCEPTED body; raises EngineError if the engine refused the request."""
        deadline = time.monotonic() + timeout
        while self.accepted is None and self.error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError
            self._has_news.clear()
            if self.accepted is None and self.error is None:
                await asyncio.wait_for(self._has_news.wait(), remaining)
        if self.error is not None and self.accepted is None:
            raise EngineError(self.error)
        return self.accepted

    async def next_update(self, timeout: float) -> Update | None:
        """What arrived since the last call; None when `timeout` passed with nothing new."""
        if not self._has_output():
            self._has_news.clear()
            if not self._has_output():
                try:
                    await asyncio.wait_for(self._has_news.wait(), timeout)
                except asyncio.TimeoutError:
                    return None
        if self.error is not None:
            raise EngineError(self.error)
        if self._ready:
            update, size = self._ready.popleft()
            self.pending_bytes -= size
            return update
        update, self._pending, self._pending_bytes, self.pending_bytes = self._pending, Update(), 0, 0
        return update

    def _has_output(self) -> bool:
        p = self._pending
        return bool(self._ready or p.text or p.reasoning or p.tool_parts or p.token_ids or p.finish_reason
                    or p.prompt_logprobs or self.error is not None)


def _starts_new_update(pending: Update, item: dict[str, Any]) -> bool:
    """Whether `item` must not merge into `pending`: an update keeps one order (reasoning, text, then
    tool-call parts, `relay.tool_calls.ToolCallRelay.events_around_text`), so text or reasoning after a
    tool call, or reasoning after text, starts the next update. A slow reader then gets the model's order:
    an agent's "think, call, think, call" stays four blocks in that order instead of two thinking pieces
    merged before both calls."""
    if not pending.tool_parts and not pending.text:
        return False
    if item.get("reasoning") and (pending.tool_parts or pending.text):
        return True
    return bool(item.get("text") and pending.tool_parts)


def _add_tool_parts(parts: list[tuple[str, dict[str, Any]]], item: dict[str, Any]) -> None:
    """An item's whole calls (closed first, in the engine's parser) then its pieces, a piece merged into the
    one before it when both belong to the same call, so an unread stream holds one piece per call."""
    parts.extend(("call", call) for call in item.get("tool_calls") or ())
    for piece in item.get("tool_call_deltas") or ():
        last = parts[-1] if parts else None
        if last is not None and last[0] == "piece" and last[1]["index"] == piece.get("index"):
            last[1]["arguments"] = last[1].get("arguments", "") + (piece.get("arguments") or "")
        else:
            parts.append(("piece", dict(piece)))
