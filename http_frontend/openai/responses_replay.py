"""A stored response as the event stream a streamed POST /v1/responses sends (GET …?stream=true).

OpenAI's `GET /v1/responses/{id}?stream=true` streams a response's events, and
`starting_after` resumes after a given `sequence_number`. The engine's store keeps
the final response object, not the events that built it, so the stream is rebuilt
from that object in `ResponseBuilder`'s order and shapes: `response.created` and
`response.in_progress`, then per output item `output_item.added`, its content part
and deltas and their `.done`s, then `response.completed` (`response.incomplete`, or
`error` + `response.failed`). Each content part's text (a call's arguments, a custom
tool's input) comes as one delta, so a response the model wrote token by token
replays in fewer events than it streamed: the replay's numbering is its own,
the same on every replay, and `starting_after` counts in it.
"""

from __future__ import annotations

from typing import Any

from http_frontend.errors import bad_request
from http_frontend.openai.responses_stream import Event

# What each content part type streams as: its delta and done events, and its empty form in `content_part.added`.
_PARTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "output_text": ("response.output_text.delta", "response.output_text.done",
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
    "reasoning_text": ("response.reasoning_text.delta", "response.reasoning_text.done",
                       {"type": "reasoning_text", "text": ""}),
}
# Call items: the field their text streams into, and their delta and done events.
_CALLS: dict[str, tuple[str, str, str]] = {
    "function_call": ("arguments", "response.function_call_arguments.delta", "response.function_call_arguments.done"),
    "custom_tool_call": ("input", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"),
}
_FINISHED = ("completed", "incomplete", "failed")


class _Numbered:
    """Events with `sequence_number` counting from 0, as `ResponseBuilder._event` numbers them."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields, "sequence_number": len(self.events)})


def replay_events(response: dict[str, Any]) -> list[Event]:
    """Every event of `response` (a stored final response object), numbered from 0."""
    out = _Numbered()
    started = {**response, "status": "in_progress", "output": [], "usage": None, "error": None,
               "incomplete_details": None, "completed_at": None}
    out.add("response.created", response=started)
    out.add("response.in_progress", response=started)
    for index, item in enumerate(response.get("output") or []):
        if item.get("type") in _CALLS:
            _call_events(out, index, item)
        else:
            _content_events(out, index, item)
    status = response.get("status")
    if status == "failed":
        error = response.get("error") or {}
        out.add("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
    if status in _FINISHED:
        out.add(f"response.{status}", response=response)
    return out.events


def _content_events(out: _Numbered, index: int, item: dict[str, Any]) -> None:
    """A message or reasoning item: its parts as `content_part.added`, one delta, then the `.done`s.

    An item still `in_progress` (a failed response stopped in it) ends where the
    builder left it: open, without `.done` events; the builder keeps its text out of
    the stored object, so only its opening part is replayed.
    """
    item_id, parts = item.get("id"), list(item.get("content") or [])
    out.add("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
    if item.get("status") == "in_progress":
        empty = "reasoning_text" if item.get("type") == "reasoning" else "output_text"
        out.add("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                part=dict(_PARTS[empty][2]))
        return
    for content_index, part in enumerate(parts):
        delta_kind, done_kind, empty_part = _PARTS.get(part.get("type"), (None, None, {"type": part.get("type")}))
        where = {"item_id": item_id, "output_index": index, "content_index": content_index}
        out.add("response.content_part.added", **where, part=dict(empty_part))
        if delta_kind is not None and done_kind is not None:
            text = part.get("text") or ""
            logprobs = {"logprobs": part.get("logprobs") or []} if part.get("type") == "output_text" else {}
            if text:
                out.add(delta_kind, **where, delta=text, **logprobs)
            out.add(done_kind, **where, text=text, **logprobs)
        out.add("response.content_part.done", **where, part=part)
    out.add("response.output_item.done", output_index=index, item=item)


def _call_events(out: _Numbered, index: int, item: dict[str, Any]) -> None:
    """A function or custom tool call: added, its text in one delta, its `.done` and the item's."""
    field, delta_kind, done_kind = _CALLS[item["type"]]
    item_id, text = item.get("id"), item.get(field) or ""
    out.add("response.output_item.added", output_index=index, item={**item, "status": "in_progress", field: ""})
    out.add(delta_kind, item_id=item_id, output_index=index, delta=text)
    if item.get("status") == "in_progress":
        return
    out.add(done_kind, item_id=item_id, output_index=index, **{field: text})
    out.add("response.output_item.done", output_index=index, item=item)


def starting_after(value: str | None, events: list[Event]) -> int:
    """`starting_after` as the sequence number to resume after (-1: from the start); a 400 when it names none."""
    if value is None:
        return -1
    last = len(events) - 1
    if not value.isascii() or not value.isdigit():
        raise bad_request(f"Invalid 'starting_after': expected a non-negative integer (an event's sequence_number), "
                          f"got {value[:40]!r}", param="starting_after")
    number = int(value) if len(value) <= 18 else None  # a longer one is past any event (and int() has a limit)
    if number is None or number > last:
        raise bad_request(f"Invalid 'starting_after': {value[:40]} is past this response's last event, whose "
                          f"sequence_number is {last}", param="starting_after")
    return number
