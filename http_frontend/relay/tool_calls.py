"""The engine's tool-call pieces and whole calls as one ordered list of start / arguments / done events.

A call the engine streams (`tool_call_deltas`) starts with its id and name, grows by argument
pieces, and is done when its whole call arrives: then only the arguments not yet streamed are
sent. A call that arrives whole (an engine that does not stream calls, a family it cannot read
while written) is one `whole` event. Chat, Responses and Anthropic streams each render these
events in their own grammar.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from http_frontend.engine.client import Update

log = logging.getLogger(__name__)


@dataclass
class ToolCallEvent:
    """`start`: `call` has "index", "id" and "name". `arguments`: `text` is the next piece.
    `done`: `call` is the whole call from the engine (its "arguments" complete, "partial" when cut)
    and `text` what was streamed of its arguments. `whole`: a call none of which was streamed."""

    kind: Literal["start", "arguments", "done", "whole"]
    index: int
    call: dict[str, Any] = field(default_factory=dict)
    text: str = ""


class ToolCallRelay:
    """Per response: what has been streamed of each call, so a whole call sends only the rest."""

    def __init__(self) -> None:
        self._streamed: dict[int, str] = {}  # call index -> arguments sent so far, while the call is open

    def events(self, update: Update) -> list[ToolCallEvent]:
        events: list[ToolCallEvent] = []
        for kind, part in update.tool_parts:
            index = part.get("index", 0)
            if kind == "piece":
                if index not in self._streamed:
                    self._streamed[index] = ""
                    events.append(ToolCallEvent("start", index, {"index": index, "id": part.get("id"),
                                                                 "name": part.get("name", "")}))
                if part.get("arguments"):
                    self._streamed[index] += part["arguments"]
                    events.append(ToolCallEvent("arguments", index, text=part["arguments"]))
                continue
            sent = self._streamed.pop(index, None)
            arguments = part.get("arguments") or ""
            if sent is None:
                events.append(ToolCallEvent("whole", index, part))
                continue
            if arguments.startswith(sent):
                if arguments[len(sent):]:
                    events.append(ToolCallEvent("arguments", index, text=arguments[len(sent):]))
                    sent = arguments
            else:
                log.warning("tool call %s: its arguments do not extend what was streamed of them", part.get("id"))
            events.append(ToolCallEvent("done", index, part, text=sent))
        return events

    def events_around_text(self, update: Update) -> tuple[list[ToolCallEvent], list[ToolCallEvent]]:
        """`events(update)` split into those of calls open before it and the rest.

        An update merges what arrived since the consumer last looked, each kind apart. A call
        open before it cannot have text inside it, so the text that came with it came after
        its end: its events go before the text, new calls' after it (where text before them goes).
        """
        before = set(self._streamed)
        events = self.events(update)
        return [e for e in events if e.index in before], [e for e in events if e.index not in before]
