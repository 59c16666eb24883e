"""What a tool-call text says while it is still being written: its name and its arguments so far.

Two readers of an unfinished call. `partial_call` reads one that max_tokens cut (OpenAI returns it
with its arguments as far as they got). `SettledReader` reads one the model is still writing and
keeps only what can no longer change, so the parser can stream the arguments while the call is
written: an agent's file write takes minutes on a laptop, and clients (Claude Code's stream
watchdog) give up on a stream that shows nothing for that long. `written_arguments` reads a
finished one as written, for when the family parser's canonical form does not extend what was
streamed.

Families: a JSON call (`{"name": …, "arguments": {…}}`, Hermes/Qwen and the JSON fallback),
Mistral's `f[ARGS]{…}` (no end marker: its call closes with the reply), Kimi K2's
`<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{…}`, Qwen3-Coder's
`<function=f><parameter=k>v</parameter>`, MiniMax-M2's `<invoke name="f"><parameter name="k">v</parameter>`,
GLM's (and Laguna's) `f<arg_key>k</arg_key><arg_value>v</arg_value>`, LongCat's the same with `longcat_` tags,
Muse Spark's `<atem:invoke name="f"><atem:parameter name="k">v</atem:parameter>`, Kimi K3's
`<|open|>call tool="f"<|sep|><|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>`,
MiniCPM5's `"f"><param name="k">v</param>`; an unclosed last value runs to the end. The bracketed
families (Gemma 4, FunctionGemma, pythonic) are `bracketed_calls`'.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from engine_daemon.output.bracketed_calls import BracketedReader, family_of, inside_string
from engine_daemon.output.markup_calls import (
    VALUE_TAGS,
    Markup,
    kept_as_text,
    markup_of,
    open_text,
    pair_matches,
    properties,
    unclosed,
    unquoted,
)

_JSON_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)+)"')
_JSON_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_JSON_CALL_START = re.compile(r'\s*\[?\s*\{\s*"name"\s*:')  # a call (or a list of them) writes its name first
# A name, then the JSON arguments: Mistral's `name[ARGS]{…}` (Devstral), Kimi K2's
# `<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{…}`, Kimi K3's JSON block
# `<|open|>call tool="name"<|sep|><|open|>json type="object"<|sep|>{…}`.
_HEADER_CALLS = (re.compile(r"\s*([\w-]+)\s*\[ARGS\]\s*"),
                 re.compile(r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?(.+?):\d+\s*<\|tool_call_argument_begin\|>\s*"),
                 re.compile(r'\s*<\|open\|>call\b(?:(?!<\|sep\|>).)*?\btool="([^"]+)"(?:(?!<\|sep\|>).)*<\|sep\|>'
                            r"\s*<\|open\|>json\b(?:(?!<\|sep\|>).)*<\|sep\|>\s*", re.DOTALL))


def _header(text: str) -> re.Match[str] | None:
    return next((found for pattern in _HEADER_CALLS if (found := pattern.match(text)) is not None), None)


# A JSON value may end with these while more of it is still to come (or they close the call around it).
_UNSETTLED_TAIL = " \t\r\n}]"

Pair = tuple[str | None, str | None, bool, str | None]  # (key, value so far, value closed, the key's attributes)


def call_dict(parsed: Any) -> list[dict[str, Any]]:
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
        out.append({"name": encodable(call["name"]), "arguments": encodable(arguments)})
    return out


def encodable(text: str) -> str:
    """`text` with any lone surrogate as its `\\uXXXX` escape (the output frame is UTF-8)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def partial_call(text: str, tools: list[dict[str, Any]] | None = None,
                 parse: Callable[..., Any] | None = None) -> dict[str, Any] | None:
    """The call a cut-off tool-call text was writing: its name, and its arguments as written so far.

    OpenAI returns a call cut by max_tokens as a call with partial arguments (finish
    `length`): the arguments are a prefix of a JSON object, not valid JSON. Key/value
    markup families get the same, their finished values converted as the family's parser
    would (strings stay strings where the schema says so). Without a complete name there
    is no call to return, and the markup is never returned as text either: None.
    """
    read = partial_call_text(text, tools, parse)
    return None if read is None else {"name": read[0], "arguments": read[1], "partial": True}


class SettledReader:
    """The settled part of a call being written: (name, arguments text that more output cannot change).

    Each reading's arguments extend the one before, and the whole call's arguments (its family
    parser's, `call_dict`) extend them all. Held back: a JSON call's closing brackets and
    whitespace (they may close the call around the arguments); in markup (Qwen3-Coder, GLM),
    a value the family parser may convert (`5`, `true`, `null`, a schema without a type) until
    it closes, and a string value's trailing whitespace and any start of its closing tag. A
    markup call's finished values are converted by the family parser itself (`parse`, run
    on the text up to the last one), so they stream exactly as the whole call will say them.
    A bracketed family's call (Gemma 4, FunctionGemma, pythonic: known by `parse`'s module, not
    by the text) is read the same way by `BracketedReader`.
    """

    def __init__(self, tools: list[dict[str, Any]] | None, parse: Callable[..., Any] | None):
        self.tools, self.parse = tools, parse
        family = family_of(parse)
        self.bracketed = None if family is None or parse is None else BracketedReader(
            family, parse, tools, lambda parsed: call_dict(parsed)[0]["arguments"])
        self._closed: tuple[int, str | None] = (-1, "{")  # (end of the last finished value, the object so far)

    def read(self, text: str, settled: bool = True) -> tuple[str, str] | None:
        """`settled=False`: a cut call's arguments, its last value as far as it got (`partial_call`); a
        bracketed call's are its settled ones (its open value may still be an escape or a number)."""
        if self.bracketed is not None:
            return self.bracketed.read(text)
        name = _JSON_NAME.search(text)
        if name is not None and _JSON_CALL_START.match(text):
            if not settled:
                return partial_call_text(text, self.tools, self.parse)
            after = _JSON_ARGUMENTS.search(text, name.end()) or _JSON_ARGUMENTS.search(text)
            return _json_name(name.group(1)), _settled_json(text[after.end():]) if after is not None else ""
        if (header := _header(text)) is not None:
            if not settled:
                return partial_call_text(text, self.tools, self.parse)
            return header.group(1), _settled_json(text[header.end():])
        found = markup_of(text, self.parse)
        if found is None or self.parse is None:  # no family parser: the JSON fallback's calls
            return None
        markup, name_match = found
        call_name = unquoted(name_match.group(1), markup)
        matches = pair_matches(markup, text, name_match.end(1))
        closed = [m for m in matches if m.group("end")]
        opened = matches[len(closed)] if len(matches) > len(closed) else None
        prefix = self._finished(text, closed[-1].end() if closed else -1, markup)
        if prefix is None:
            return call_name, ""
        if opened is None or not opened.group("keyend"):  # nothing more, or a key still being written
            return call_name, prefix
        key = unquoted(opened.group("key"), markup)
        head = ("" if prefix == "{" else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        value = opened.group("value")
        if value is None:
            return call_name, prefix + head
        value = open_text(unclosed(value, markup.ends), markup, settled)
        schema = properties(call_name, self.tools).get(key)
        if value is None or settled and not kept_as_text(markup, schema, opened.groupdict().get("attrs"), value,
                                                           settled=True):
            return call_name, prefix + head  # the family may convert it (Qwen3-Coder reads "null" as null)
        return call_name, prefix + head + json.dumps(value, ensure_ascii=False)[:-1]

    def _finished(self, text: str, end: int, markup: Markup) -> str | None:
        """The arguments object's text through its last finished value, as the family parser converts it."""
        if end == self._closed[0]:
            return self._closed[1]
        prefix: str | None = "{"
        if end >= 0:
            if self.parse is None:
                prefix = None
            else:
                try:
                    arguments = call_dict(self.parse(text[:end] + markup.closer, self.tools))[0]
                    prefix = arguments["arguments"][:-1] if arguments["arguments"].endswith("}") else None
                except Exception:  # the family cannot read it (yet): nothing more streams until it can
                    prefix = None
        self._closed = (end, prefix)
        return prefix


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:(")|\\?$)', re.DOTALL)  # group 1: its closing quote


def inside_value(text: str, parse: Callable[..., Any] | None = None) -> bool:
    """Whether a call's text so far ends inside one of its values: a JSON string, an open `<parameter=…>`
    (before `</function>`) or `<arg_value>` (`VALUE_TAGS`), a string of the bracketed family `parse` reads.
    The end-of-call marker written there is the value's text (a file that mentions `</tool_call>`), not
    the call's end. Linear, in C (`re`, `rfind`)."""
    if (family := family_of(parse)) is not None:
        return inside_string(text, family)
    if text.lstrip()[:1] in ("{", "["):  # a JSON call, its name first or not
        last = None
        for last in _JSON_STRING.finditer(text):
            pass
        return last is not None and last.end() == len(text) and not last.group(1)
    for opening, closings in VALUE_TAGS:
        at = text.rfind(opening)
        if at >= 0:
            return at > max(text.rfind(closing) for closing in closings)
    return False


def written_arguments(text: str, tools: list[dict[str, Any]] | None = None, strict: bool = True,
                      parse: Callable[..., Any] | None = None) -> str | None:
    """A finished call's arguments as the model wrote them (a JSON object's own text); None when not JSON.

    `strict=False` also takes NaN and Infinity (not JSON: only for a call returned as `partial`).
    """
    read = partial_call_text(text, tools, parse)
    if read is None:
        return None
    arguments = read[1] if written_as_json(text) else read[1] + "}"
    try:
        value, end = (_STRICT_JSON if strict else json.JSONDecoder()).raw_decode(arguments)
    except (ValueError, RecursionError):
        return None
    return arguments[:end] if isinstance(value, dict) else None


def written_as_json(text: str) -> bool:
    """Whether a call's arguments are written as a JSON object (a JSON call, Mistral's, Kimi K2's): whole
    when that object is, where a markup call whose parser refused it is not."""
    return bool(_JSON_CALL_START.match(text) or _header(text))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)  # NaN and Infinity: strict clients refuse them


def partial_call_text(text: str, tools: list[dict[str, Any]] | None = None,
                      parse: Callable[..., Any] | None = None) -> tuple[str, str] | None:
    """(name, arguments as written so far) of a cut call, as `partial_call` reads it (`parse`: `markup_of`)."""
    name = _JSON_NAME.search(text)
    if name is not None and _JSON_CALL_START.match(text):  # a top-level name: a nested "name" is no call
        after = _JSON_ARGUMENTS.search(text, name.end()) or _JSON_ARGUMENTS.search(text)
        return _json_name(name.group(1)), text[after.end():].rstrip() if after is not None else ""
    if (header := _header(text)) is not None:
        return header.group(1), text[header.end():].rstrip()
    found = markup_of(text, parse)
    if found is None:
        return None
    markup, name_match = found
    call_name = unquoted(name_match.group(1), markup)
    pairs = [(unquoted(m.group("key"), markup) if m.group("keyend") else None, m.group("value"), bool(m.group("end")),
              m.groupdict().get("attrs")) for m in pair_matches(markup, text, name_match.end(1))]
    return call_name, _partial_object(call_name, pairs, tools, markup)


def _settled_json(arguments: str) -> str:
    """The settled part of a JSON call's arguments text: an object's text up to where it may still change."""
    if not arguments.startswith("{"):  # a string of JSON, or nothing yet: it streams when the call closes
        return ""
    try:
        _, end = json.JSONDecoder().raw_decode(arguments)
        arguments = arguments[:end]  # whole: what follows is the call's own text
    except (ValueError, RecursionError):
        pass
    return arguments.rstrip(_UNSETTLED_TAIL)


def _partial_object(name: str, pairs: list[Pair], tools: list[dict[str, Any]] | None, markup: Markup) -> str:
    """(key, value so far, value closed) pairs as the prefix of a JSON object, stopping at the first unfinished part."""
    schemas = properties(name, tools)
    parts = []
    for key, value, closed, attrs in pairs:
        if key is None:  # the key itself is unfinished: nothing of it is known
            break
        key = key.strip()
        head = json.dumps(key, ensure_ascii=False) + ": "
        if value is None:
            parts.append(head)
            break
        if markup.strips:  # GLM's and MiniMax's parsers strip every value; Qwen3-Coder's only a newline each side
            value = value.strip() if closed else value.lstrip()
        if not closed:  # an unfinished value: an unterminated JSON string, as a streamed string would be
            value = unclosed(value, markup.ends)
            parts.append(head + json.dumps(value, ensure_ascii=False)[:-1])
            break
        is_string = kept_as_text(markup, schemas.get(key), attrs, value, settled=False)
        parts.append(head + (json.dumps(value, ensure_ascii=False) if is_string else _json_value(value)))
    return "{" + ", ".join(parts)


def _json_name(raw: str) -> str:
    """A JSON call's name as its text decodes (`write\\u005ffile` is `write_file`)."""
    try:
        name = json.loads(f'"{raw}"')
    except ValueError:
        return raw
    return name if isinstance(name, str) else raw


def _json_value(value: str) -> str:
    """A finished markup value that is not a string parameter: JSON if it parses, else the text."""
    try:
        return json.dumps(json.loads(value.strip()), ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):  # not JSON, NaN, or nested past what json can follow
        return json.dumps(value.strip(), ensure_ascii=False)
