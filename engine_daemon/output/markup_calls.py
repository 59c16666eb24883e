"""The key/value markup families' table, and how each family's parser converts a value.

A row per family (`MARKUPS`): how its name and its (key, value) pairs are written, what closes a call
and a value, and which conversion rule its mlx-lm parser applies to a value (`kept_as_text`), so the
readers in `call_text` stream a value as written only where the family keeps it as written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Markup:
    """A key/value markup family: how its name and its (key, value) pairs are written.

    `pairs` has groups `key`, `keyend` (the key is whole), `value` and `end` (the value is closed), and
    `attrs` where the key's tag says the value's type; an unclosed last value runs to the end. `closer`
    makes the text up to a finished value a whole call for the family parser; `ends`: what closes a value.
    `rule`: how the parser converts a value (`kept_as_text`). `strips`: the parser strips every value
    (else only the newline after and before its tags). `unquote`: names and keys may be written in
    quotes. `cdata`: a value may be a CDATA block, kept as written. `call_end`: the parser ends the call
    at the first one, in a value or not; `last_end`: at the first one outside a value. `modules`: the
    mlx-lm parsers that read it; `loose`: its name pattern matches other text, so only they look for it.
    """

    family: str
    name: re.Pattern[str]
    pairs: re.Pattern[str]
    closer: str
    ends: tuple[str, ...]
    rule: str
    strips: bool
    unquote: bool = False
    cdata: bool = False
    call_end: str = ""
    last_end: str = ""
    modules: tuple[str, ...] = ()
    loose: bool = False


MARKUPS = (
    Markup("qwen3_coder", re.compile(r"<function=([^>\s]+)>"),
           re.compile(r"<parameter=(?P<key>[^>\s]+)(?P<keyend>>)\n?(?P<value>.*?)(?P<end>\n?</parameter>|$)",
                      re.DOTALL), "\n</function>", ("\n</parameter>", "</parameter>"), "qwen3_coder", strips=False,
           modules=("qwen3_coder",)),
    Markup("minimax", re.compile(r"<invoke name=([^>]+)>"),
           re.compile(r"<parameter name=(?P<key>[^>]+)(?P<keyend>>)(?P<value>.*?)(?P<end></parameter>|$)", re.DOTALL),
           "</invoke>", ("</parameter>",), "schema_types", strips=True, unquote=True, modules=("minimax_m2",)),
    Markup("glm", re.compile(r"^\s*([^<>\s]+)\s*<arg_key>"),
           re.compile(r"<arg_key>(?P<key>.*?)(?:(?P<keyend></arg_key>)\s*(?:<arg_value>(?P<value>.*?)"
                      r"(?P<end></arg_value>|$))?|$)", re.DOTALL), "", ("</arg_value>",), "schema_type", strips=True,
           modules=("glm47", "laguna")),
    Markup("longcat", re.compile(r"^\s*([^<>\s]+)\s*<longcat_arg_key>"),
           re.compile(r"<longcat_arg_key>(?P<key>.*?)(?:(?P<keyend></longcat_arg_key>)\s*(?:<longcat_arg_value>"
                      r"(?P<value>.*?)(?P<end></longcat_arg_value>|$))?|$)", re.DOTALL), "",
           ("</longcat_arg_value>",), "schema_type", strips=True, modules=("longcat",)),
    Markup("muse_spark", re.compile(r'<atem:invoke\b[^>]*?\bname="([^"]+)">'),
           re.compile(r'<atem:parameter\b[^>]*?\bname="(?P<key>[^"]+)"[^>]*?(?P<keyend>>)(?P<value>.*?)'
                      r"(?P<end></atem:parameter>|$)", re.DOTALL), "</atem:invoke>", ("</atem:parameter>",),
           "json_or_text", strips=True, last_end="</atem:invoke>", modules=("muse_spark",)),
    Markup("kimi_k3", re.compile(r'<\|open\|>call\b(?:(?!<\|sep\|>).)*?\btool="([^"]+)"(?:(?!<\|sep\|>).)*<\|sep\|>',
                                 re.DOTALL),
           re.compile(r'<\|open\|>argument(?P<attrs>(?:(?!<\|sep\|>).)*?\bkey="(?P<key>[^"]*)"(?:(?!<\|sep\|>).)*)'
                      r"(?P<keyend><\|sep\|>)(?P<value>.*?)(?P<end><\|close\|>argument<\|sep\|>|$)", re.DOTALL),
           "<|close|>call<|sep|>", ("<|close|>argument<|sep|>", "<|close|>call<|sep|>"), "type_attr", strips=False,
           call_end="<|close|>call<|sep|>", modules=("kimi_k3",)),
    # Last: its name is only `"f">` (the start marker `<function name=` is not the call's text).
    Markup("minicpm5", re.compile(r"""^\s*("[^"]*"|'[^']*'|[^\s"'<>]+)\s*>"""),
           re.compile(r"""<param\s+name\s*=\s*(?P<key>"[^"]*"|'[^']*'|[^\s"'<>]+)\s*(?P<keyend>>)(?P<value>.*?)"""
                      r"(?P<end></param>|$)", re.DOTALL), "", ("</param>",), "schema_types", strips=True,
           unquote=True, cdata=True, modules=("minicpm5",), loose=True),
)
# Where a value's text starts, and what ends it: the end-of-call marker between them is the value's text
# (the family parser reads it so). Not MiniCPM5's: its parser ends the call at the first `</function>`.
VALUE_TAGS = (("<parameter", ("</parameter>", "</function>", "</invoke>")), ("<arg_value>", ("</arg_value>",)),
              ("<longcat_arg_value>", ("</longcat_arg_value>",)), ("<atem:parameter", ("</atem:parameter>",)),
              ("<|open|>argument", ("<|close|>argument<|sep|>", "<|close|>call<|sep|>")),
              ("<|open|>json", ("<|close|>json<|sep|>",)))
_CDATA = "<![CDATA["
_JSON_STARTS = frozenset('{["-0123456789')
_JSON_WORDS = ("true", "false", "null", "NaN", "Infinity")  # what `json.loads` reads besides those
_TYPE_ATTR = re.compile(r'\btype="([^"]*)"')
# Qwen3-Coder's parser keeps these schema types as written (mlx-lm `qwen3_coder._string_types`).
_XML_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def markup_of(text: str, parse: Callable[..., Any] | None = None) -> tuple[Markup, re.Match[str]] | None:
    """The markup family `text` is written in, and its name's match; None before a name is written. Only
    the family of `parse` (an mlx-lm parser) where it is one: MiniCPM5's `"f">` is junk to Gemma 4."""
    module = (getattr(parse, "__module__", None) or "").rsplit(".", 1)[-1]
    for markup in [m for m in MARKUPS if module in m.modules] or [m for m in MARKUPS if not m.loose]:
        if (found := markup.name.search(text)) is not None:
            return markup, found
    return None


def pair_matches(markup: Markup, text: str, start: int) -> list[re.Match[str]]:
    """The call's (key, value) matches from `start`, up to where the family parser ends the call: a
    parameter after Muse Spark's `</atem:invoke>` is another call's, or junk."""
    if markup.call_end and (end := text.find(markup.call_end, start)) >= 0:
        text = text[:end]
    matches: list[re.Match[str]] = []
    for match in markup.pairs.finditer(text, start):
        if markup.last_end and markup.last_end in text[matches[-1].end() if matches else start:match.start()]:
            break
        matches.append(match)
    return matches


def unquoted(text: str, markup: Markup) -> str:
    """A name or key as its family reads it (MiniMax's may be quoted: `<invoke name="f">`)."""
    text = text.strip()
    if markup.unquote and len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def properties(name: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The parameter schemas of the tool `name`, {} where the request says none (or nothing usable)."""
    schemas: dict[str, Any] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name and isinstance(function.get("parameters"), dict):
            found = function["parameters"].get("properties")
            schemas = found if isinstance(found, dict) else {}  # a schema may be `true`, a list, anything
    return schemas


def kept_as_text(markup: Markup, schema: Any, attrs: str | None, value: str, settled: bool) -> bool:
    """Whether the family's parser keeps this value as written text (mlx-lm's rules); `settled`: whatever
    more is written of it (a value that may yet read `null` is not)."""
    if markup.rule == "json_or_text":  # Muse Spark: JSON where it parses, else the text
        text = value.strip()
        return bool(text) and text[0] not in _JSON_STARTS and not any(word.startswith(text) for word in _JSON_WORDS)
    if markup.rule == "type_attr":  # Kimi K3: as the key's `type` says, text when it says none
        types = _TYPE_ATTR.findall(attrs or "")
        return (types[-1] if types else "string") == "string"
    if not _is_string(schema, markup):
        return False
    return markup.rule == "schema_type" or not (settled and "null".startswith(value.lower()))


def _is_string(schema: Any, markup: Markup) -> bool:
    """Whether the family's parser keeps this parameter's value as written text (mlx-lm's rules)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if markup.rule == "schema_type":  # GLM, LongCat
        return kind == "string"
    if markup.rule == "schema_types":  # MiniMax, MiniCPM5: text unless its schema allows another type (anyOf...)
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


def open_text(value: str, markup: Markup, settled: bool) -> str | None:
    """An open value's text as its family will read it (stripped, or a CDATA block's as written); None
    while a CDATA block's opening is still being written."""
    body = value.lstrip()
    if markup.cdata and body and _CDATA.startswith(body[:len(_CDATA)]):
        if len(body) < len(_CDATA):
            return None
        body = body[len(_CDATA):]
        end = body.rfind("]]>")
        if end >= 0 and not body[end + 3:].strip():  # the block's end, unless more text follows it
            body = body[:end]
        return unclosed(body, ("]]>",))
    value = body if markup.strips else value
    return value.rstrip() if settled else value


def unclosed(value: str, closers: tuple[str, ...]) -> str:
    """An unfinished value without the start of its closing tag (`…\n</param`, `…</para` cut mid-tag)."""
    longest = 0
    for closer in closers:
        for size in range(min(len(closer), len(value)), longest, -1):
            if value.endswith(closer[:size]):
                longest = size
                break
    return value[:len(value) - longest]
