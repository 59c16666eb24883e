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
GLM's `f<arg_key>k</arg_key><arg_value>v</arg_value>`; an unclosed last value runs to the end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_JSON_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)+)"')
_JSON_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_JSON_CALL_START = re.compile(r'\s*\[?\s*\{\s*"name"\s*:')  # a call (or a list of them) writes its name first
# A name, then the JSON arguments: Mistral's `name[ARGS]{…}` (Devstral), Kimi K2's
# `<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{…}`.
_HEADER_CALLS = (re.compile(r"\s*([\w-]+)\s*\[ARGS\]\s*"),
                 re.compile(r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?(.+?):\d+\s*<\|tool_call_argument_begin\|>\s*"))


def _header(text: str) -> re.Match[str] | None:
    return next((found for pattern in _HEADER_CALLS if (found := pattern.match(text)) is not None), None)


@dataclass(frozen=True)
class _Markup:
    """A key/value markup family: how its name and its (key, value) pairs are written.

    `pairs` has groups `key`, `keyend` (the key is whole), `value` and `end` (the value is closed); an
    unclosed last value runs to the end. `closer` makes the text up to a finished value a whole call for
    the family parser. `strips`: the parser strips every value (else only the newline after and before
    its tags). `unquote`: names and keys may be written in quotes.
    """

    family: str
    name: re.Pattern[str]
    pairs: re.Pattern[str]
    closer: str
    strips: bool
    unquote: bool = False


_MARKUPS = (
    _Markup("qwen3_coder", re.compile(r"<function=([^>\s]+)>"),
            re.compile(r"<parameter=(?P<key>[^>\s]+)(?P<keyend>>)\n?(?P<value>.*?)(?P<end>\n?</parameter>|$)",
                       re.DOTALL), "\n</function>", strips=False),
    _Markup("minimax", re.compile(r"<invoke name=([^>]+)>"),
            re.compile(r"<parameter name=(?P<key>[^>]+)(?P<keyend>>)(?P<value>.*?)(?P<end></parameter>|$)", re.DOTALL),
            "</invoke>", strips=True, unquote=True),
    _Markup("glm", re.compile(r"^\s*([^<>\s]+)\s*<arg_key>"),
            re.compile(r"<arg_key>(?P<key>.*?)(?:(?P<keyend></arg_key>)\s*(?:<arg_value>(?P<value>.*?)"
                       r"(?P<end></arg_value>|$))?|$)", re.DOTALL), "", strips=True),
)
# Qwen3-Coder's parser keeps these schema types as written (mlx-lm `qwen3_coder._string_types`).
_XML_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
# A JSON value may end with these while more of it is still to come (or they close the call around it).
_UNSETTLED_TAIL = " \t\r\n}]"

Pair = tuple[str | None, str | None, bool]  # (key, value so far, value closed)


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


def partial_call(text: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The call a cut-off tool-call text was writing: its name, and its arguments as written so far.

    OpenAI returns a call cut by max_tokens as a call with partial arguments (finish
    `length`): the arguments are a prefix of a JSON object, not valid JSON. Key/value
    markup families get the same, their finished values converted as the family's parser
    would (strings stay strings where the schema says so). Without a complete name there
    is no call to return, and the markup is never returned as text either: None.
    """
    read = partial_call_text(text, tools)
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
    """

    def __init__(self, tools: list[dict[str, Any]] | None, parse: Callable[..., Any] | None):
        self.tools, self.parse = tools, parse
        self._closed: tuple[int, str | None] = (-1, "{")  # (end of the last finished value, the object so far)

    def read(self, text: str, settled: bool = True) -> tuple[str, str] | None:
        """`settled=False`: a cut call's arguments, its last value as far as it got (`partial_call`)."""
        name = _JSON_NAME.search(text)
        if name is not None and _JSON_CALL_START.match(text):
            if not settled:
                return partial_call_text(text, self.tools)
            after = _JSON_ARGUMENTS.search(text, name.end()) or _JSON_ARGUMENTS.search(text)
            return _json_name(name.group(1)), _settled_json(text[after.end():]) if after is not None else ""
        if (header := _header(text)) is not None:
            if not settled:
                return partial_call_text(text, self.tools)
            return header.group(1), _settled_json(text[header.end():])
        found = _markup(text)
        if found is None or self.parse is None:  # no family parser: the JSON fallback's calls
            return None
        markup, name_match = found
        call_name = _unquoted(name_match.group(1), markup)
        matches = list(markup.pairs.finditer(text, name_match.end(1)))
        closed = [m for m in matches if m.group("end")]
        opened = matches[len(closed)] if len(matches) > len(closed) else None
        prefix = self._finished(text, closed[-1].end() if closed else -1, markup)
        if prefix is None:
            return call_name, ""
        if opened is None or not opened.group("keyend"):  # nothing more, or a key still being written
            return call_name, prefix
        key = _unquoted(opened.group("key"), markup)
        head = ("" if prefix == "{" else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        value = opened.group("value")
        if value is None:
            return call_name, prefix + head
        value = _unclosed(value.lstrip() if markup.strips else value)
        if settled:
            value = value.rstrip()
            schema = _properties(call_name, self.tools).get(key)
            if not _is_string(schema, markup) or (markup.family != "glm" and "null".startswith(value.lower())):
                return call_name, prefix + head  # the family may convert it (Qwen3-Coder reads "null" as null)
        return call_name, prefix + head + json.dumps(value, ensure_ascii=False)[:-1]

    def _finished(self, text: str, end: int, markup: _Markup) -> str | None:
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


def inside_value(text: str) -> bool:
    """Whether a call's text so far ends inside one of its values: a JSON string, an open `<parameter=…>`
    (before `</function>`) or `<arg_value>`. The end-of-call marker written there is the value's text
    (a file that mentions `</tool_call>`), not the call's end. Linear, in C (`re`, `rfind`)."""
    if text.lstrip()[:1] in ("{", "["):  # a JSON call, its name first or not
        last = None
        for last in _JSON_STRING.finditer(text):
            pass
        return last is not None and last.end() == len(text) and not last.group(1)
    parameter = text.rfind("<parameter")  # Qwen3-Coder's `<parameter=k>`, MiniMax's `<parameter name="k">`
    if parameter >= 0:
        return parameter > max(text.rfind("</parameter>"), text.rfind("</function>"), text.rfind("</invoke>"))
    value = text.rfind("<arg_value>")
    return value >= 0 and value > text.rfind("</arg_value>")


def written_arguments(text: str, tools: list[dict[str, Any]] | None = None, strict: bool = True) -> str | None:
    """A finished call's arguments as the model wrote them (a JSON object's own text); None when not JSON.

    `strict=False` also takes NaN and Infinity (not JSON: only for a call returned as `partial`).
    """
    read = partial_call_text(text, tools)
    if read is None:
        return None
    arguments = read[1] if _JSON_CALL_START.match(text) or _header(text) else read[1] + "}"
    try:
        value, end = (_STRICT_JSON if strict else json.JSONDecoder()).raw_decode(arguments)
    except (ValueError, RecursionError):
        return None
    return arguments[:end] if isinstance(value, dict) else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)  # NaN and Infinity: strict clients refuse them


def partial_call_text(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, str] | None:
    """(name, arguments as written so far) of a cut call, as `partial_call` reads it."""
    name = _JSON_NAME.search(text)
    if name is not None and _JSON_CALL_START.match(text):  # a top-level name: a nested "name" is no call
        after = _JSON_ARGUMENTS.search(text, name.end()) or _JSON_ARGUMENTS.search(text)
        return _json_name(name.group(1)), text[after.end():].rstrip() if after is not None else ""
    if (header := _header(text)) is not None:
        return header.group(1), text[header.end():].rstrip()
    found = _markup(text)
    if found is None:
        return None
    markup, name_match = found
    call_name = _unquoted(name_match.group(1), markup)
    pairs = [(_unquoted(m.group("key"), markup) if m.group("keyend") else None, m.group("value"), bool(m.group("end")))
             for m in markup.pairs.finditer(text, name_match.end(1))]
    return call_name, _partial_object(call_name, pairs, tools, markup)


def _markup(text: str) -> tuple[_Markup, re.Match[str]] | None:
    """The markup family `text` is written in, and its name's match; None before a name is written."""
    for markup in _MARKUPS:
        if (found := markup.name.search(text)) is not None:
            return markup, found
    return None


def _unquoted(text: str, markup: _Markup) -> str:
    """A name or key as its family reads it (MiniMax's may be quoted: `<invoke name="f">`)."""
    text = text.strip()
    if markup.unquote and len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


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


def _partial_object(name: str, pairs: list[Pair], tools: list[dict[str, Any]] | None, markup: _Markup) -> str:
    """(key, value so far, value closed) pairs as the prefix of a JSON object, stopping at the first unfinished part."""
    properties = _properties(name, tools)
    parts = []
    for key, value, closed in pairs:
        if key is None:  # the key itself is unfinished: nothing of it is known
            break
        key = key.strip()
        head = json.dumps(key, ensure_ascii=False) + ": "
        is_string = _is_string(properties.get(key), markup)
        if value is None:
            parts.append(head)
            break
        if markup.strips:  # GLM's and MiniMax's parsers strip every value; Qwen3-Coder's only a newline each side
            value = value.strip() if closed else value.lstrip()
        if not closed:  # an unfinished value: an unterminated JSON string, as a streamed string would be
            value = _unclosed(value)
            parts.append(head + json.dumps(value, ensure_ascii=False)[:-1])
            break
        parts.append(head + (json.dumps(value, ensure_ascii=False) if is_string else _json_value(value)))
    return "{" + ", ".join(parts)


def _properties(name: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name and isinstance(function.get("parameters"), dict):
            found = function["parameters"].get("properties")
            properties = found if isinstance(found, dict) else {}  # a schema may be `true`, a list, anything
    return properties


def _is_string(schema: Any, markup: _Markup) -> bool:
    """Whether the family's parser keeps this parameter's value as written text (mlx-lm's rules)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if markup.family == "glm":
        return kind == "string"
    if markup.family == "minimax":  # text unless its schema allows another type (anyOf, enum, a type list...)
        return _schema_types(schema) <= {"string", "str", "text"}
    if not schema:  # Qwen3-Coder: a parameter the schema does not describe stays text
        return True
    if not isinstance(schema, dict):
        return False
    return kind is not None and str(kind).strip().lower() in _XML_STRING_TYPES


def _schema_types(schema: Any) -> set[str]:
    """The types a parameter's schema allows, as MiniMax's parser reads them ("string" when it says none)."""
    if not isinstance(schema, dict):
        return {"string"}
    kinds = schema.get("type")
    types = {kinds} if isinstance(kinds, str) else {k for k in kinds if isinstance(k, str)} \
        if isinstance(kinds, list) else set()
    for value in schema.get("enum") or () if isinstance(schema.get("enum"), list) else ():
        types.add("string" if isinstance(value, str) else "other")
    for choice in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(choice) or () if isinstance(schema.get(choice), list) else ():
            types |= _schema_types(option)
    return {kind.lower() for kind in types} or {"string"}


def _unclosed(value: str) -> str:
    """An unfinished value without the start of its closing tag (`…\n</param`, `…</para` cut mid-tag)."""
    longest = 0
    for closer in ("\n</parameter>", "</parameter>", "</arg_value>"):
        for size in range(min(len(closer), len(value)), longest, -1):
            if value.endswith(closer[:size]):
                longest = size
                break
    return value[:len(value) - longest]


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
