"""What a tool-call text says while it is still being written: its name and its arguments so far.

Two readers of an unfinished call. `partial_call` reads one that max_tokens cut (OpenAI returns it
with its arguments as far as they got). `settled_call` reads one the model is still writing and
keeps only what can no longer change, so the parser can stream the arguments while the call is
written: an agent's file write takes minutes on a laptop, and clients (Claude Code's stream
watchdog) give up on a stream that shows nothing for that long. `written_arguments` reads a
finished one as written, for when the family parser's canonical form does not extend what was
streamed.

Families: a JSON call (`{"name": …, "arguments": {…}}`, Hermes/Qwen and the JSON fallback),
Qwen3-Coder's `<function=f><parameter=k>v</parameter>`, GLM's
`f<arg_key>k</arg_key><arg_value>v</arg_value>`; an unclosed last value runs to the end.
"""

from __future__ import annotations

import json
import re
from typing import Any

_JSON_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)+)"')
_JSON_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_JSON_CALL_START = re.compile(r'\s*\[?\s*\{\s*"name"\s*:')  # a call (or a list of them) writes its name first
_XML_NAME = re.compile(r"<function=([^>\s]+)>")
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)(\n?</parameter>|$)", re.DOTALL)
_GLM_NAME = re.compile(r"^\s*([^<>\s]+)\s*<arg_key>")
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)(</arg_key>\s*(?:<arg_value>(.*?)(</arg_value>|$))?|$)", re.DOTALL)
# Qwen3-Coder's parser keeps these schema types as written (mlx-lm `qwen3_coder._string_types`).
_XML_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
# A JSON value may end with these while more of it is still to come (or they close the call around it).
_UNSETTLED_TAIL = " \t\r\n}]"

Pair = tuple[str | None, str | None, bool]  # (key, value so far, value closed)


def partial_call(text: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The call a cut-off tool-call text was writing: its name, and its arguments as written so far.

    OpenAI returns a call cut by max_tokens as a call with partial arguments (finish
    `length`): the arguments are a prefix of a JSON object, not valid JSON. Key/value
    markup families get the same, their finished values converted as the family's parser
    would (strings stay strings where the schema says so). Without a complete name there
    is no call to return, and the markup is never returned as text either: None.
    """
    read = _read(text, tools, settled=False)
    return None if read is None else {"name": read[0], "arguments": read[1], "partial": True}


def settled_call(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, str] | None:
    """(name, arguments text that more output cannot change) of a call being written; None before its name.

    Each later result's arguments extend the earlier one's. Held back: a JSON call's closing
    brackets and whitespace (they may close the call around the arguments), a markup value
    that is not a string (`3` may become `30`), and a string value's trailing whitespace
    that its closing tag may take.
    """
    return _read(text, tools, settled=True)


def written_arguments(text: str, tools: list[dict[str, Any]] | None = None) -> str | None:
    """A finished call's arguments as the model wrote them (a JSON object's own text); None when not JSON."""
    read = _read(text, tools, settled=False)
    if read is None:
        return None
    arguments = read[1] if _JSON_CALL_START.match(text) else read[1] + "}"
    try:
        value, end = json.JSONDecoder().raw_decode(arguments)
    except (ValueError, RecursionError):
        return None
    return arguments[:end] if isinstance(value, dict) else None


def _read(text: str, tools: list[dict[str, Any]] | None, settled: bool) -> tuple[str, str] | None:
    name = _JSON_NAME.search(text)
    if name is not None and _JSON_CALL_START.match(text):  # a top-level name: a nested "name" is no call
        after = _JSON_ARGUMENTS.search(text, name.end()) or _JSON_ARGUMENTS.search(text)
        arguments = text[after.end():].rstrip() if after is not None else ""
        return name.group(1), _settled_json(text[after.end():]) if settled and after is not None else arguments
    xml, glm = _XML_NAME.search(text), _GLM_NAME.search(text)
    if xml is not None:
        pairs = [(m.group(1), m.group(2), bool(m.group(3))) for m in _XML_PARAMETER.finditer(text, xml.end())]
        return xml.group(1), _partial_object(xml.group(1), pairs, tools, settled, glm=False)
    if glm is not None:
        pairs = [(m.group(1) if m.group(2) else None, m.group(3), bool(m.group(4)))
                 for m in _GLM_ARGUMENT.finditer(text, glm.end(1))]
        return glm.group(1), _partial_object(glm.group(1), pairs, tools, settled, glm=True)
    return None


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


def _partial_object(name: str, pairs: list[Pair], tools: list[dict[str, Any]] | None, settled: bool,
                    glm: bool) -> str:
    """(key, value so far, value closed) pairs as the prefix of a JSON object, stopping at the first unfinished part."""
    properties = _properties(name, tools)
    parts = []
    for key, value, closed in pairs:
        if key is None:  # the key itself is unfinished: nothing of it is known
            break
        key = key.strip()
        head = json.dumps(key, ensure_ascii=False) + ": "
        is_string = _is_string(properties.get(key), glm)
        if value is None or (settled and not closed and not is_string):
            parts.append(head)
            break
        if glm:  # GLM's parser strips every value; Qwen3-Coder's only the newline after and before its tags
            value = value.strip() if closed else value.lstrip()
        if not closed:  # an unfinished value: an unterminated JSON string, as a streamed string would be
            value = _unclosed(value)
            parts.append(head + json.dumps(value.rstrip() if settled else value, ensure_ascii=False)[:-1])
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


def _is_string(schema: Any, glm: bool) -> bool:
    """Whether the family's parser keeps this parameter's value as written text (mlx-lm's rules)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if glm:
        return kind == "string"
    if not isinstance(schema, dict):  # Qwen3-Coder: a parameter the schema does not name stays text
        return True
    return kind is not None and str(kind).strip().lower() in _XML_STRING_TYPES


def _unclosed(value: str) -> str:
    """An unfinished value without the start of its closing tag (`…\n</param` cut mid-tag)."""
    for closer in ("\n</parameter>", "</arg_value>"):
        for size in range(min(len(closer), len(value)), 0, -1):
            if value.endswith(closer[:size]):
                return value[:-size]
    return value


def _json_value(value: str) -> str:
    """A finished markup value that is not a string parameter: JSON if it parses, else the text."""
    try:
        return json.dumps(json.loads(value.strip()), ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):  # not JSON, NaN, or nested past what json can follow
        return json.dumps(value.strip(), ensure_ascii=False)
