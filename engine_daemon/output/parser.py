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
_JSON_CALL_START = re.compile(r'\s*\[?\s*\{\s*"name"\s*:')  # a call (or a list of them) writes its name first
# Key/value markup families: Qwen3-Coder's `<function=f><parameter=k>v</parameter>`, GLM's
# `f<arg_key>k</arg_key><arg_value>v</arg_value>`; an unclosed last value runs to the end.
_XML_NAME = re.compile(r"<function=([^>\s]+)>")
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)(\n?</parameter>|$)", re.DOTALL)
_GLM_NAME = re.compile(r"^\s*([^<>\s]+)\s*<arg_key>")
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)(</arg_key>\s*(?:<arg_value>(.*?)(</arg_value>|$))?|$)", re.DOTALL)


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
    """A tool parser's result (one call or a list) as [{"name", "arguments"}], arguments a JSON string.

    NaN and Infinity are not JSON (strict clients' `JSON.parse` rejects them): such a call is unparsable.
    A lone surrogate (`"\\ud800"` decoded) cannot travel as UTF-8: it stays an escape.
    """
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"not a tool call: {call!r}")
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        out.append({"name": _encodable(call["name"]), "arguments": _encodable(arguments)})
    return out


def _encodable(text: str) -> str:
    """`text` with any lone surrogate as its `\\uXXXX` escape (the output frame is UTF-8)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_json_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The JSON fallback (Llama 3 style): `{"name", "arguments"|"parameters"}` or a list of those."""
    return _call_dict(json.loads(text.strip()))


def leading_json_calls(text: str) -> tuple[list[dict[str, Any]], str] | None:
    """The JSON fallback's calls at the start of `text` and the text after them (`{...}\\n\\nI called f.`)."""
    stripped = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
        return _call_dict(value), stripped[end:]
    except (ValueError, RecursionError):
        return None


def partial_call(text: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The call a cut-off tool-call text was writing: its name, and its arguments as written so far.

    OpenAI returns a call cut by max_tokens as a call with partial arguments (finish
    `length`): the arguments are a prefix of a JSON object, not valid JSON. Key/value
    markup families get the same, their finished values converted as the family's parser
    would (strings stay strings where the schema says so). Without a complete name there
    is no call to return, and the markup is never returned as text either: None.
    """
    name = _JSON_NAME.search(text)
    if name is not None and _JSON_CALL_START.match(text):  # a top-level name: a nested "name" is no call
        after = _JSON_ARGUMENTS.search(text, name.end()) or _JSON_ARGUMENTS.search(text)
        arguments = text[after.end():].rstrip() if after is not None else ""
        return {"name": name.group(1), "arguments": arguments, "partial": True}
    xml, glm = _XML_NAME.search(text), _GLM_NAME.search(text)
    if xml is not None:
        pairs = [(m.group(1), m.group(2), bool(m.group(3)))
                 for m in _XML_PARAMETER.finditer(text, xml.end())]
        return {"name": xml.group(1), "arguments": _partial_object(xml.group(1), pairs, tools), "partial": True}
    if glm is not None:
        pairs = [(m.group(1) if m.group(2) else None, m.group(3), bool(m.group(4)))
                 for m in _GLM_ARGUMENT.finditer(text, glm.end(1))]
        return {"name": glm.group(1), "arguments": _partial_object(glm.group(1), pairs, tools), "partial": True}
    return None


def _partial_object(name: str, pairs: list[tuple[str | None, str | None, bool]],
                    tools: list[dict[str, Any]] | None) -> str:
    """(key, value so far, value closed) pairs as the prefix of a JSON object, stopping at the first unfinished part."""
    properties: dict[str, Any] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name and isinstance(function.get("parameters"), dict):
            found = function["parameters"].get("properties")
            properties = found if isinstance(found, dict) else {}  # a schema may be `true`, a list, anything
    parts = []
    for key, value, closed in pairs:
        if key is None:  # the key itself is unfinished: nothing of it is known
            break
        head = json.dumps(key.strip(), ensure_ascii=False) + ": "
        if value is None:
            parts.append(head)
            break
        if not closed:  # an unfinished value: an unterminated JSON string, as a streamed string would be
            parts.append(head + json.dumps(_unclosed(value), ensure_ascii=False)[:-1])
            break
        schema = properties.get(key.strip())
        parts.append(head + _json_value(value.strip(), schema.get("type") if isinstance(schema, dict) else None))
    return "{" + ", ".join(parts)


def _unclosed(value: str) -> str:
    """An unfinished value without the start of its closing tag (`…\n</param` cut mid-tag)."""
    for closer in ("\n</parameter>", "</arg_value>"):
        for size in range(min(len(closer), len(value)), 0, -1):
            if value.endswith(closer[:size]):
                return value[:-size]
    return value


def _json_value(value: str, kind: Any) -> str:
    """A finished markup value as JSON: a string where the schema says so, else JSON if it parses."""
    if kind != "string":
        try:
            return json.dumps(json.loads(value), ensure_ascii=False, allow_nan=False)
        except (ValueError, RecursionError):  # not JSON, NaN, or nested past what json can follow
            pass
    return json.dumps(value, ensure_ascii=False)


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
        self.partial_calls = 0  # of them, calls written only in part (cut, or ended mid-call)
        self.seen_content = False
        self.after_thinking = False  # the newlines a template puts after </think> are not answer text
        # Whitespace at the end of the answer text so far, held until real text follows: next to
        # tool-call markup it is the model's layout, not content (a "\n" between two calls became
        # a text part). Held whatever the token boundaries, so streaming and not agree.
        self.pending_space = ""
        self.after_call = False  # nothing but whitespace since the last tool call closed

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
            self._emit(out, self.buffer[:position])
            self.buffer = self.buffer[position + len(marker):]
            self._switch(out, marker)
        if final:
            self._finish(out, cut)
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
        parse = self.tool_parser if self.state == TOOL else parse_json_tool_calls
        try:
            calls = _call_dict(parse(text, self.tools))
        except Exception as exc:
            if self.state == JSON_TOOL and (leading := leading_json_calls(text)) is not None:
                calls, rest = leading  # whole calls, then the model's own text: both kept
                out.text += rest
                self._add_calls(out, calls, cut=False)
                return
            try:  # the parse of a hostile text must end this call, never the request (or the batch)
                # A JSON answer the model ended itself is the answer (a nested "name" made it a call).
                wanted = raw_if_invalid is not None and (cut or self.state == TOOL)
                written = partial_call(text, self.tools) if wanted else None
            except (ValueError, RecursionError):
                written = None
            if written is not None and self.state == JSON_TOOL and written["name"] not in self._tool_names():
                written = None  # a cut JSON answer that names no tool is the answer, not a call
            if written is not None:  # cut by max_tokens: the call as far as it got, as OpenAI returns it
                calls = [written]
            elif raw_if_invalid is not None and self.state == TOOL:
                log.info("tool call cut before its name (%s): dropped, markup is never text", exc)
                return
            else:  # a complete but malformed call must not lose the text
                log.info("unparsable tool call (%s): returned as text", exc)
                out.text += raw_if_invalid if raw_if_invalid is not None else text
                return
        self._add_calls(out, calls, cut)

    def _add_calls(self, out: ParsedDelta, calls: list[dict[str, Any]], cut: bool) -> None:
        for call in calls:
            if cut:
                call["partial"] = True
            self.partial_calls += bool(call.get("partial"))
            call["index"] = self.tool_calls
            # Always our own id: a model-made one may be anything (a 100-digit number once made the
            # DELTAS frame unencodable), and clients expect a unique string.
            call["id"] = f"call_{uuid.uuid4().hex[:24]}"
            self.tool_calls += 1
            out.tool_calls.append(call)
        self.after_call = True

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
