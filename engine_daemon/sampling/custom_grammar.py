"""A custom tool's grammar (Lark or regex) rewritten to hold for its input written as a JSON string.

Why: the model writes a custom tool's call in its family's JSON markup, as the function
call `{"input": "<text>"}` (the front-end offers a custom tool as a function with one
string parameter, `http_frontend.openai.responses_tools`). The client's grammar is for
the raw text, so a forced call must follow it through JSON escaping: a newline of the
grammar is the two characters `\\n` in the output, a quote is `\\"`. llguidance quotes a
regex into a JSON string itself (a schema's `pattern`) but not a context-free grammar,
so this module rewrites the Lark grammar:

- string literals become their JSON-escaped text;
- regexes become Lark expressions (`regex_expression`): runs of characters that need no
  escape are lexemes, each escape sequence is its own literal. Why not one regex per
  terminal: llguidance's lexer never backtracks, so a terminal that may go on with `\\"`
  would swallow the `\\` of a following `\\n` and fail;
- terminals (UPPERCASE) become rules, since they now hold rule-level alternatives, and
  `%import common.X` brings in Lark's common terminal `X`, rewritten the same way.

What cannot be rewritten (`%ignore`, anchors, back-references, regex flags but `s`)
raises `Unsupported`; the caller then constrains the input only as a JSON string.
"""

from __future__ import annotations

import json
import logging
import re
import re._constants as sre  # the regex parser's opcodes: the public `re` has no parse tree
import re._parser as sre_parse
from typing import Any

from llguidance import LLMatcher

log = logging.getLogger(__name__)

# The escape each character needing one gets in the output (json.dumps' choice).
ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
SPECIALS = [chr(code) for code in range(0x20)] + ['"', "\\"]
NO_ESCAPE_CLASS = '["\\\\\\x00-\\x1F]'  # the characters above, as a regex class
# Lark's common.lark terminals (the ones grammars import), as regexes.
COMMON = {
    "LF": r"\n", "CR": r"\r", "NEWLINE": r"(\r?\n)+", "WS": r"[ \t\f\r\n]+", "WS_INLINE": r"[ \t]+",
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+", "NUMBER": r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?",
    "SIGNED_NUMBER": r"[+-]?[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?", "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]", "LETTER": r"[A-Za-z]", "WORD": r"[A-Za-z]+", "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "ESCAPED_STRING": r'"([^"\\]|\\.)*"', "SH_COMMENT": r"#[^\n]*", "CPP_COMMENT": r"//[^\n]*",
}
_TOKENS = re.compile(r'(?P<comment>//[^\n]*)|(?P<string>"(?:\\.|[^"\\\n])*"(?P<sflags>i?))'
                     r"|(?P<regex>/(?:\\.|[^/\\\n])+/(?P<rflags>[imslux]*))|(?P<term>\b_?[A-Z][_A-Z0-9]*\b)"
                     r"|(?P<other>.)", re.DOTALL)
_IMPORT = re.compile(r"^%import\s+common\s*(?:\.\s*(\w+)(?:\s*->\s*(\w+))?|\(([\w\s,]*)\))\s*$", re.MULTILINE)


class Unsupported(ValueError):
    """A grammar feature this rewrite does not carry into a JSON string."""


class InvalidGrammar(ValueError):
    """A grammar no text can follow: a literal or regex naming a lone UTF-16 surrogate (`"\\ud800"`), which is
    not valid Unicode. Refused (400), not left unenforced: llguidance cannot even be handed it."""


def literal(text: str) -> str:
    """The Lark literal matching `text` as it reads inside a JSON string."""
    return json.dumps(json.dumps(text, ensure_ascii=False)[1:-1], ensure_ascii=False)


def _char(code: int) -> str:
    """A character in a class as both Python's `re` and llguidance's (Rust) regexes read it."""
    return f"\\U{code:08x}"


def _class_text(items: list[tuple[Any, Any]]) -> str:
    """A parsed character class back as regex text (Rust syntax, which llguidance reads)."""
    categories = {sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D", sre.CATEGORY_SPACE: r"\s",
                  sre.CATEGORY_NOT_SPACE: r"\S", sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_WORD: r"\W"}
    parts = []
    for op, av in items:
        if op is sre.NEGATE:
            parts.insert(0, "^")
        elif op is sre.LITERAL:
            parts.append(_char(av))
        elif op is sre.RANGE:
            parts.append(f"{_char(av[0])}-{_char(av[1])}")
        elif op is sre.CATEGORY and av in categories:
            parts.append(categories[av])
        else:
            raise Unsupported(f"character class item {op}")
    return "[" + "".join(parts) + "]"


def _class_expression(cls: str, repeated: str = "") -> str:
    """Characters of `cls`: a lexeme for those needing no escape, a literal per escape that matches."""
    run = f"/[{cls}--{NO_ESCAPE_CLASS}]{'+' if repeated else ''}/"
    matching = [ch for ch in SPECIALS if re.fullmatch(cls, ch)]
    escapes = [literal(ch) for ch in matching if ch in ESCAPES]
    unicode_escapes = [literal(ch) for ch in matching if ch not in ESCAPES]
    if len(unicode_escapes) == len(SPECIALS) - len(ESCAPES):  # all of them: one lexeme
        unicode_escapes = [r"/\\u00[01][0-9a-fA-F]/"]
    escapes += unicode_escapes
    return f"({' | '.join([run, *escapes])}){repeated}"


def _single_class(op: Any, av: Any, dotall: bool) -> str | None:
    """The class text of a one-character node (`.`, `[...]`, `[^x]`), None for other nodes."""
    if op is sre.ANY:
        return r"[\s\S]" if dotall else r"[^\n]"
    if op is sre.NOT_LITERAL:
        return f"[^{_char(av)}]"
    if op is sre.IN:
        return _class_text(av)
    return None


def _sequence(nodes: Any, dotall: bool) -> str:
    parts: list[str] = []
    text = ""
    for op, av in nodes:
        if op is sre.LITERAL:
            text += chr(av)
            continue
        if text:
            parts.append(literal(text))
            text = ""
        parts.append(_node(op, av, dotall))
    if text:
        parts.append(literal(text))
    return " ".join(part for part in parts if part)


def _node(op: Any, av: Any, dotall: bool) -> str:
    cls = _single_class(op, av, dotall)
    if cls is not None:
        return _class_expression(cls)
    if op is sre.SUBPATTERN:
        _group, add_flags, del_flags, pattern = av
        if add_flags or del_flags:
            raise Unsupported("inline regex flags")
        inner = _sequence(pattern, dotall)
        return f"({inner})" if inner else ""
    if op is sre.BRANCH:
        alternatives = [_sequence(branch, dotall) for branch in av[1]]
        present = [alt for alt in alternatives if alt]
        if not present:
            return ""
        return f"({' | '.join(present)})" + ("?" if len(present) < len(alternatives) else "")
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
        low, high, pattern = av
        if len(pattern) == 1 and high is sre.MAXREPEAT and low <= 1:
            cls = _single_class(*pattern[0], dotall)
            if cls is not None:  # `.*`, `[^x]+`: runs as one lexeme, not one per character
                return _class_expression(cls, "*" if low == 0 else "+")
        inner = _sequence(pattern, dotall)
        if not inner:
            return ""
        if high is sre.MAXREPEAT:
            return f"({inner})" + ("*" if low == 0 else "+" if low == 1 else f" ~ {low} ({inner})*")
        if (low, high) == (0, 1):
            return f"({inner})?"
        return f"({inner}) ~ {low}..{high}" if low != high else f"({inner}) ~ {low}"
    raise Unsupported(f"regex construct {op}")


def regex_expression(pattern: str, flags: str = "") -> str:
    """A Lark expression matching the JSON-escaped text of what `pattern` matches (whole)."""
    if set(flags) - {"s"}:
        raise Unsupported(f"regex flags {flags!r}")
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise Unsupported(f"regex {pattern!r}: {exc}") from None
    expression = _sequence(parsed, "s" in flags)
    if not expression:
        raise Unsupported(f"regex {pattern!r} matches only the empty string")
    return expression


def _term_rule(name: str) -> str:
    return "tok_" + name.lower().lstrip("_")


def json_string_grammar(definition: str) -> str:
    """A Lark grammar (with `start`) for the JSON-string form of `definition`'s language; Unsupported if not."""
    lines = []
    for match in _IMPORT.finditer(definition):
        names = [(match.group(1), match.group(2))] if match.group(1) else \
            [(name.strip(), None) for name in match.group(3).split(",") if name.strip()]
        for name, alias in names:
            if name not in COMMON:
                raise Unsupported(f"%import common.{name}")
            lines.append(f"{_term_rule(alias or name)}: {regex_expression(COMMON[name])}")
    body = _IMPORT.sub("", definition)
    if re.search(r"^\s*%", body, re.MULTILINE):
        raise Unsupported("directives other than %import common")
    out = []
    for token in _TOKENS.finditer(body):
        if token.group("string") is not None:
            if token.group("sflags"):
                raise Unsupported("case-insensitive strings")
            out.append(literal(json.loads(token.group("string"))))
        elif token.group("regex") is not None:
            flags = token.group("rflags")
            pattern = token.group("regex")[1:-1 - len(flags)].replace("\\/", "/")
            out.append(f"({regex_expression(pattern, flags)})")
        elif token.group("term") is not None:
            out.append(_term_rule(token.group("term")))
        elif token.group("comment") is None:
            out.append(token.group(0))
    grammar = "\n".join(["".join(out).strip(), *lines])
    try:
        grammar.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidGrammar("it names a lone UTF-16 surrogate, which is not valid Unicode") from None
    return grammar


def custom_lark(parameters: Any) -> str | None:
    """A custom tool's Lark grammar: the `x-lark` of its one `input` string (`responses_tools._custom_tool`)."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    field = properties.get("input") if isinstance(properties, dict) else None
    grammar = field.get("x-lark") if isinstance(field, dict) else None
    return grammar if isinstance(grammar, str) else None


def input_rule(definition: str) -> str | None:
    """The arguments rule `{"input": "<text following the grammar>"}`, or None where it cannot be built.

    None (logged) for a grammar this rewrite cannot carry or that llguidance refuses:
    the call is then held to its JSON schema only, never refused for the rewrite's limits.
    """
    try:
        inner = json_string_grammar(definition)
    except Unsupported as exc:
        log.warning("custom tool grammar not enforced: %s", exc)
        return None
    rule = f'"{{\\"input\\": \\"" %lark {{\n{inner}\n}} "\\"}}"'
    failed, messages = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(f"start: {rule}\n"))
    if failed:
        log.warning("custom tool grammar not enforced: %s", " ".join(messages)[:500])
        return None
    return rule
