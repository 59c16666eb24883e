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
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_daemon.output.bounded_parse import bounded
from engine_daemon.output.call_text import (
    SettledReader,
    call_dict,
    encodable,
    inside_value,
    partial_call,
    written_arguments,
    written_as_json,
)

log = logging.getLogger(__name__)

CONTENT, REASONING, TOOL, JSON_TOOL = "content", "reasoning", "tool", "json_tool"


@dataclass
class ParsedDelta:
    """What one step added: answer text, reasoning text, complete tool calls, and pieces of the one being written.

    `tool_call_deltas`: [{"index", "arguments"}] for the call being written, its first piece with
    its "id" and "name" too. The complete call comes later in `tool_calls` under the same index
    and id, and its arguments extend what the pieces said.
    """

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_deltas: list[dict[str, Any]] = field(default_factory=list)


def _held_back(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def parse_json_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The JSON fallback (Llama 3 style): `{"name", "arguments"|"parameters"}` or a list of those."""
    return call_dict(json.loads(text.strip()))


def leading_json_calls(text: str) -> tuple[list[dict[str, Any]], str] | None:
    """The JSON fallback's calls at the start of `text` and the text after them (`{...}\\n\\nI called f.`)."""
    stripped = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
        return call_dict(value), stripped[end:]
    except (ValueError, RecursionError):
        return None


class OutputParser:
    """Incremental splitter for one request; `feed` each text delta, `final=True` on the last."""

    def __init__(self, tokenizer: Any, *, in_thinking: bool, tools: list[dict[str, Any]] | None):
        self.think_start = getattr(tokenizer, "think_start", None)
        self.think_end = getattr(tokenizer, "think_end", None)
        self.tools = tools or None
        parser = getattr(tokenizer, "tool_parser", None) if self.tools else None
        self.tool_parser: Callable[..., Any] | None = bounded(parser) if parser is not None else None
        self.tool_start = getattr(tokenizer, "tool_call_start", None) if parser else None
        self.tool_end = getattr(tokenizer, "tool_call_end", None) if parser else None
        # No family parser but tools were given: a reply that is one JSON value may be a call.
        self.json_fallback = bool(self.tools) and parser is None
        self.state = REASONING if in_thinking and self.think_end else CONTENT
        self.buffer = ""
        self.tool_text = ""
        self.tool_calls = 0
        self.partial_calls = 0  # of them, calls written only in part (cut, or ended mid-call)
        self.seen_content = False
        self.after_thinking = False  # the newlines a template puts after </think> are not answer text
        # Whitespace at the end of the answer text so far, held until real text follows: next to
        # tool-call markup it is the model's layout, not content (a "\n" between two calls became
        # a text part). Held whatever the token boundaries, so streaming and not agree.
        self.pending_space = ""
        self.after_call = False  # nothing but whitespace since the last tool call closed
        # The call being written whose name and arguments were streamed: {"index", "id", "name", "sent"}.
        self.open_call: dict[str, Any] | None = None
        self.reader: SettledReader | None = None  # the call being written, read as it settles
        self.settled_at = -1  # length of `tool_text` when `reader` last read it

    @property
    def in_reasoning(self) -> bool:
        """Inside a thinking block (as far as the text fed so far shows)."""
        return self.state == REASONING

    def _tool_names(self) -> set[str]:
        return {(tool.get("function") or tool).get("name") for tool in self.tools or ()}

    def _markers(self) -> list[str]:
        if self.state == REASONING:
            return [self.think_end]
        if self.state == TOOL:
            return [self.tool_end] if self.tool_end else []
        markers = [m for m in (self.tool_start, self.think_start) if m]
        return markers

    def feed(self, text: str, final: bool = False, cut: bool = False) -> ParsedDelta:
        """Splits one text delta; `final` on the last, with `cut` when max_tokens (or the context) ended it.

        A cut final delta returns the calls of an unterminated tool-call block marked
        `partial`, even when the family's parser reads them (it may skip an unfinished
        argument), and drops a trailing start of the tool-call marker: markup is never text.
        """
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
                if final and cut and self.state == CONTENT and self.tools and self.tool_start:
                    # "<tool" when max_tokens struck: a marker being written (one character could be text).
                    dropped = _held_back(self.buffer, [self.tool_start])
                    self.buffer = self.buffer[:len(self.buffer) - dropped] if dropped > 1 else self.buffer
                self._emit(out, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            if self.state == TOOL and marker == self.tool_end and inside_value(  # `</tool_call>` inside a string value
                    self.tool_text + self.buffer[:position], self.tool_parser):
                self._emit(out, self.buffer[:position + len(marker)])
                self.buffer = self.buffer[position + len(marker):]
                continue
            self._emit(out, self.buffer[:position])
            self.buffer = self.buffer[position + len(marker):]
            self._switch(out, marker)
        if final:
            self._finish(out, cut)
        elif self.state in (TOOL, JSON_TOOL):
            self._stream_call(out)
        return out

    def _stream_call(self, out: ParsedDelta) -> None:
        """Streams the settled part of the call being written (`SettledReader`): its name, then its arguments.

        Re-read when the text grew by 1/32 since the last reading, so a call of n characters
        costs O(n) in all, not O(n) per token.
        """
        text = self.tool_text
        if len(text) - self.settled_at < max(1, self.settled_at // 32):
            return
        self.settled_at = len(text)
        if self.reader is None:
            self.reader = SettledReader(self.tools, self.tool_parser if self.state == TOOL else None)
        try:
            settled = self.reader.read(text)
        except (ValueError, RecursionError):
            return
        if settled is None:
            return
        name, arguments = settled
        if self.open_call is None:
            if self.state == JSON_TOOL and name not in self._tool_names():
                return  # a JSON answer, until it names a tool
            self.open_call = {"index": self.tool_calls, "id": f"call_{uuid.uuid4().hex[:24]}",
                              "name": encodable(name), "sent": ""}
            out.tool_call_deltas.append({"index": self.tool_calls, "id": self.open_call["id"],
                                         "name": self.open_call["name"], "arguments": ""})
        sent = self.open_call["sent"]
        if len(arguments) > len(sent) and arguments.startswith(sent):
            piece = encodable(arguments[len(sent):])
            self.open_call["sent"] = sent + piece
            if out.tool_call_deltas and out.tool_call_deltas[-1]["index"] == self.open_call["index"]:
                out.tool_call_deltas[-1]["arguments"] += piece
            else:
                out.tool_call_deltas.append({"index": self.open_call["index"], "arguments": piece})

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
            if not self.tools:
                out.text += text
                self.seen_content = self.seen_content or bool(text.strip())
                return
            body = text.rstrip()
            if not body:
                self.pending_space += text  # held: a tool call may follow (see `pending_space`)
                return
            if self.after_call:  # the layout after a call is not the start of the text that follows
                body, self.pending_space, self.after_call = body.lstrip(), "", False
            out.text += self.pending_space + body
            self.pending_space = text[len(text.rstrip()):]
            self.seen_content = True

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

    def _close_tool(self, out: ParsedDelta, raw_if_invalid: str | None = None, cut: bool = False) -> None:
        text, self.tool_text = self.tool_text, ""
        reader, self.reader, self.settled_at = self.reader, None, -1
        parse = self.tool_parser if self.state == TOOL else parse_json_tool_calls
        try:
            calls = call_dict(parse(text, self.tools))
        except Exception as exc:
            if self.state == JSON_TOOL and (leading := leading_json_calls(text)) is not None:
                calls, rest = leading  # whole calls, then the model's own text: both kept
                out.text += rest
                self._add_calls(out, calls, cut=False, text=text)
                return
            try:  # the parse of a hostile text must end this call, never the request (or the batch)
                # A JSON answer the model ended itself is the answer (a nested "name" made it a call).
                wanted = raw_if_invalid is not None and (cut or self.state == TOOL)
                written = partial_call(text, self.tools, self._parse()) if wanted else None
            except (ValueError, RecursionError):
                written = None
            if written is not None and self.state == JSON_TOOL and written["name"] not in self._tool_names():
                written = None  # a cut JSON answer that names no tool is the answer, not a call
            if self.open_call is not None or (written is None and self._announceable(text)):
                # Streamed as a call (or it would have been, had it come in smaller pieces): a call, as written.
                written = self._as_written(text, reader) or written
            if written is not None:  # cut by max_tokens: the call as far as it got, as OpenAI returns it
                calls = [written]
            elif raw_if_invalid is not None and self.state == TOOL:
                log.info("tool call cut before its name (%s): dropped, markup is never text", exc)
                return
            else:  # a complete but malformed call must not lose the text
                log.info("unparsable tool call (%s): returned as text", exc)
                out.text += raw_if_invalid if raw_if_invalid is not None else text
                return
        self._add_calls(out, calls, cut, text, reader)

    def _parse(self) -> Callable[..., Any] | None:
        """The family parser of the call being read: none for the JSON fallback's."""
        return self.tool_parser if self.state == TOOL else None

    def _announceable(self, text: str) -> bool:
        """Whether `_stream_call` would have announced this call: a name written (in the JSON fallback, a tool's)."""
        if self.state == TOOL:
            return True
        try:
            read = partial_call(text, self.tools, self._parse())
        except (ValueError, RecursionError):
            return False
        return read is not None and read["name"] in self._tool_names()

    def _as_written(self, text: str, reader: SettledReader | None) -> dict[str, Any] | None:
        """A call whose text its parser could not read, as written, its arguments extending what was streamed:
        a whole JSON object (junk after it left out), else as far as they go (`partial`); None without a name."""
        if self.open_call is not None:
            name, sent = self.open_call["name"], self.open_call["sent"]
        else:
            read = partial_call(text, self.tools, self._parse())
            if read is None:  # a bracketed call (Gemma 4, pythonic): as its reader reads it
                reader = reader or SettledReader(self.tools, self.tool_parser if self.state == TOOL else None)
                settled = reader.read(text, settled=False) if reader.bracketed is not None else None
                if settled is None:
                    return None
                read = {"name": settled[0]}
            name, sent = read["name"], ""
        whole = written_arguments(text, self.tools, parse=self._parse())
        if whole is not None and whole.startswith(sent):  # markup its parser refused: malformed, so partial
            return {"name": name, "arguments": whole, **({} if written_as_json(text) else {"partial": True})}
        lenient = written_arguments(text, self.tools, strict=False, parse=self._parse())  # NaN: not JSON, so partial
        if lenient is not None and lenient.startswith(sent):
            return {"name": name, "arguments": lenient, "partial": True}
        reader = reader or SettledReader(self.tools, self.tool_parser if self.state == TOOL else None)
        try:
            read = reader.read(text, settled=False)
        except (ValueError, RecursionError):
            read = None
        arguments = read[1] if read is not None and read[1].startswith(sent) else sent
        return {"name": name, "arguments": arguments, "partial": True}

    def _add_calls(self, out: ParsedDelta, calls: list[dict[str, Any]], cut: bool, text: str = "",
                   reader: SettledReader | None = None) -> None:
        if not calls and self.open_call is not None:  # `[]`: the call streamed so far is still a call
            calls = [{"name": self.open_call["name"], "arguments": self.open_call["sent"], "partial": True}]
        for call in calls:
            if cut:
                call["partial"] = True
            # Always our own id: a model-made one may be anything (a 100-digit number once made the
            # DELTAS frame unencodable), and clients expect a unique string.
            call["id"] = f"call_{uuid.uuid4().hex[:24]}"
            if self.open_call is not None:  # the streamed call: its id, and arguments that extend the pieces
                call["id"] = self.open_call["id"]
                self._extend_streamed(call, text, reader)
                self.open_call = None
            self.partial_calls += bool(call.get("partial"))
            call["index"] = self.tool_calls
            self.tool_calls += 1
            out.tool_calls.append(call)
        self.open_call, self.settled_at = None, -1
        self.after_call = True

    def _extend_streamed(self, call: dict[str, Any], text: str, reader: SettledReader | None) -> None:
        """Makes the call's arguments extend what was streamed of them.

        The family parser's canonical JSON (`{"a": 1}`) may differ from what the model wrote
        (`{"a":1}`) and was streamed: then the arguments as written are the call's, when they are
        the same JSON value (checked). A call whose parse dropped a streamed part (an unclosed last
        value) is the call as far as it was written, `partial`. Streaming and not agree.
        """
        sent = self.open_call["sent"]
        if call["arguments"].startswith(sent):
            return
        try:
            written = written_arguments(text, self.tools, parse=self._parse())
            if written is not None and written.startswith(sent) and json.loads(written) == json.loads(
                    call["arguments"]):
                call["arguments"] = encodable(written)
                return
            read = reader.read(text, settled=False) if reader is not None else None
        except (ValueError, RecursionError):
            read = None
        if read is not None and read[1].startswith(sent):
            call["arguments"], call["partial"] = encodable(read[1]), True
        else:
            log.warning("tool call %s: its arguments do not extend the %d characters streamed of them",
                        call["name"], len(sent))

    def _finish(self, out: ParsedDelta, cut: bool = False) -> None:
        """End of generation: an unterminated tool call is parsed if it can be, else returned as the
        call it was writing (`partial_call`), else dropped: markup is never answer text."""
        if self.state == TOOL and self.tool_text.strip():
            self._close_tool(out, raw_if_invalid=(self.tool_start or "") + self.tool_text, cut=cut)
        elif self.state == JSON_TOOL:
            self._close_tool(out, raw_if_invalid=self.tool_text, cut=cut)
        if self.pending_space and not self.after_call:
            out.text += self.pending_space  # no call follows it: it was the answer's own whitespace
        self.pending_space, self.after_call = "", False
        self.state = CONTENT
