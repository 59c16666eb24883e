"""Splits a request's generated text into answer text, reasoning and tool calls.

Runs in the engine after stop-string handling, so every front-end (Chat,
Responses, Anthropic) gets the same split and streaming agrees with
non-streaming. Markers come from mlx-lm's TokenizerWrapper (`think_start`,
`think_end`, `tool_call_start`, `tool_call_end`, `tool_parser`), which infers
them per model family. A suffix that could be the start of a marker is held
back until the next token decides it, so markup never leaks into `content`.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

CONTENT, REASONING, TOOL, JSON_TOOL = "content", "reasoning", "tool", "json_tool"
# A call cut short (max_tokens): its name once complete, then whatever arguments text followed.
_JSON_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)+)"')
_JSON_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_XML_NAME = re.compile(r"<function=([^>\s]+)>")


@dataclass
class ParsedDelta:
    """What one step added: answer text, reasoning text, complete tool calls."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _held_back(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def _call_dict(parsed: Any) -> list[dict[str, Any]]:
    """A tool parser's result (one call or a list) as [{"name", "arguments"}], arguments a JSON string."""
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"not a tool call: {call!r}")
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"name": call["name"], "arguments": arguments})
    return out


def parse_json_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The JSON fallback (Llama 3 style): `{"name", "arguments"|"parameters"}` or a list of those."""
    return _call_dict(json.loads(text.strip()))


def partial_call(text: str) -> dict[str, Any] | None:
    """The call a cut-off tool-call text was writing: its name, and its arguments as written so far.

    OpenAI returns a call cut by max_tokens as a call with partial arguments (finish
    `length`); without a complete name there is no call to return (and never markup as text).
    """
    name = _JSON_NAME.search(text) or _XML_NAME.search(text)
    if name is None:
        return None
    arguments = ""
    after = _JSON_ARGUMENTS.search(text, name.end()) or _JSON_ARGUMENTS.search(text)
    if after is not None:
        arguments = text[after.end():].rstrip()
    elif _XML_NAME.match(name.group(0)):
        arguments = text[name.end():].strip()
    return {"name": name.group(1), "arguments": arguments, "partial": True}


class OutputParser:
    """Incremental splitter for one request; `feed` each text delta, `final=True` on the last."""

    def __init__(self, tokenizer: Any, *, in_thinking: bool, tools: list[dict[str, Any]] | None):
        self.think_start = getattr(tokenizer, "think_start", None)
        self.think_end = getattr(tokenizer, "think_end", None)
        self.tools = tools or None
        parser = getattr(tokenizer, "tool_parser", None) if self.tools else None
        self.tool_parser: Callable[..., Any] | None = parser
        self.tool_start = getattr(tokenizer, "tool_call_start", None) if parser else None
        self.tool_end = getattr(tokenizer, "tool_call_end", None) if parser else None
        # No family parser but tools were given: a reply that is one JSON value may be a call.
        self.json_fallback = bool(self.tools) and parser is None
        self.state = REASONING if in_thinking and self.think_end else CONTENT
        self.buffer = ""
        self.tool_text = ""
        self.tool_calls = 0
        self.seen_content = False
        self.after_thinking = False  # the newlines a template puts after </think> are not answer text
        # Whitespace-only answer text, held until real text follows: around tool calls it is the
        # model's layout between markup, not content (a "\n" between two calls became a text part).
        self.pending_space = ""

    @property
    def in_reasoning(self) -> bool:
        """Inside a thinking block (as far as the text fed so far shows)."""
        return self.state == REASONING

    def _markers(self) -> list[str]:
        if self.state == REASONING:
            return [self.think_end]
        if self.state == TOOL:
            return [self.tool_end] if self.tool_end else []
        markers = [m for m in (self.tool_start, self.think_start) if m]
        return markers

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        self.buffer += text
        while True:
            if self.state == JSON_TOOL:
                self.tool_text += self.buffer
                self.buffer = ""
                break
            if self.state == CONTENT and self.json_fallback and not self.seen_content:
                stripped = self.buffer.lstrip()
                if not stripped:
                    break
                if stripped[0] in "{[":
                    self.state, self.tool_text, self.buffer = JSON_TOOL, stripped, ""
                    continue
                self.seen_content = True
            position, marker = self._next_marker()
            if marker is None:
                keep = 0 if final else _held_back(self.buffer, self._markers())
                self._emit(out, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            self._emit(out, self.buffer[:position])
            self.buffer = self.buffer[position + len(marker):]
            self._switch(out, marker)
        if final:
            self._finish(out)
        return out

    def _next_marker(self) -> tuple[int, str | None]:
        best: tuple[int, str | None] = (-1, None)
        for marker in self._markers():
            position = self.buffer.find(marker)
            if position >= 0 and (best[1] is None or position < best[0]):
                best = (position, marker)
        return best

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        if self.state == REASONING:
            out.reasoning += text
        elif self.state == TOOL:
            self.tool_text += text
        else:
            if self.after_thinking:
                text = text.lstrip("\n")
                self.after_thinking = not text
            if text and not text.strip() and self.tools:
                self.pending_space += text  # held: a tool call may follow (see `pending_space`)
                return
            out.text += self.pending_space + text
            self.pending_space = ""
            self.seen_content = self.seen_content or bool(text.strip())

    def _switch(self, out: ParsedDelta, marker: str) -> None:
        if self.state == REASONING:  # think_end
            self.state, self.after_thinking = CONTENT, True
        elif self.state == TOOL:  # tool_end
            self._close_tool(out)
            self.state = CONTENT
        elif marker == self.tool_start:
            self.state, self.tool_text, self.pending_space = TOOL, "", ""
        else:  # think_start in the answer: the model opened its own thinking block
            self.state = REASONING

    def _close_tool(self, out: ParsedDelta, raw_if_invalid: str | None = None) -> None:
        text, self.tool_text = self.tool_text, ""
        parse = self.tool_parser if self.state == TOOL else parse_json_tool_calls
        try:
            calls = _call_dict(parse(text, self.tools))
        except Exception as exc:
            cut = partial_call(text) if raw_if_invalid is not None and self.state == TOOL else None
            if cut is not None:  # cut by max_tokens: the call as far as it got, as OpenAI returns it
                calls = [cut]
            elif raw_if_invalid is not None and self.state == TOOL:
                log.info("tool call cut before its name (%s): dropped, markup is never text", exc)
                return
            else:  # a complete but malformed call must not lose the text
                log.info("unparsable tool call (%s): returned as text", exc)
                out.text += raw_if_invalid if raw_if_invalid is not None else text
                return
        for call in calls:
            call["index"] = self.tool_calls
            # Always our own id: a model-made one may be anything (a 100-digit number once made the
            # DELTAS frame unencodable), and clients expect a unique string.
            call["id"] = f"call_{uuid.uuid4().hex[:24]}"
            self.tool_calls += 1
            out.tool_calls.append(call)

    def _finish(self, out: ParsedDelta) -> None:
        """End of generation: an unterminated tool call is parsed if it can be, else returned as text."""
        if self.state == TOOL and self.tool_text.strip():
            self._close_tool(out, raw_if_invalid=(self.tool_start or "") + self.tool_text)
        elif self.state == JSON_TOOL:
            self._close_tool(out, raw_if_invalid=self.tool_text)
        if self.pending_space and not self.tool_calls:
            out.text += self.pending_space  # no call came: it was the answer's own whitespace
        self.pending_space = ""
        self.state = CONTENT
