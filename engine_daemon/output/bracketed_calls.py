"""Calls written as a name and a bracketed argument list, read while they are written.

Gemma 4's `call:f{path:<|"|>x<|"|>,n:5}`, FunctionGemma's `call:f{path:<escape>x<escape>}` and the
pythonic `[f(path="x", n=5)]` (LFM2, Llama 3.2) quote their strings their own way, and Gemma 4 and
FunctionGemma look the same until a string is written, so the family is the parser's (its module), not
the text's. What they share: a value is finished at a separator outside every string and inner bracket,
and the family parser reads the call up to there once its brackets are closed (`_closers`). So the family
parser converts every finished value, and only a string value streams while it is written, decoded by the
family's own literal rules (none for Gemma's delimiters, Python's for the pythonic calls), its key and
quote as the parser writes them for an empty string (the probe).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_CLOSING = {"{": "}", "[": "]", "(": ")"}
Decode = Callable[[str, str, bool], "str | None"]  # (quote, body, closed) → the string's text so far


@dataclass(frozen=True)
class Bracketed:
    """A family's call syntax. `head`: group 1 the name, ending inside the brackets `opened` (outermost
    first). `tokens`: a string (`quote`, `body`, `close` empty when open), an `open` or `shut` bracket, a
    `sep`. `empty`: an empty string literal. `decode`: a string's text, None where it cannot tell yet.
    `decodes`: whether the family parser reads a call's strings as `decode` does (not where it falls
    back to another reading); None: always."""

    head: re.Pattern[str]
    opened: str
    tokens: re.Pattern[str]
    empty: str
    decode: Decode
    decodes: Callable[[str], bool] | None = None


def _delimited(delimiter: str) -> Decode:
    """Strings between two delimiters, taken as written (Gemma 4's `<|"|>`, FunctionGemma's `<escape>`)."""
    def decode(quote: str, body: str, closed: bool) -> str | None:
        if closed:
            return body
        for size in range(min(len(delimiter) - 1, len(body)), 0, -1):  # `…<|"`: the delimiter may be coming
            if body.endswith(delimiter[:size]):
                return body[:-size]
        return body
    return decode


# An escape that more text may still change: `\x4`, `\u00e`, `\12` (octal runs to 3 digits), `\N{…`, `\`.
_OPEN_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]?|u[0-9a-fA-F]{0,3}|U[0-9a-fA-F]{0,7}|N(?:\{[^}]*)?|[0-7]{1,2})?\Z")


def _python_text(quote: str, body: str, closed: bool) -> str | None:
    """A Python string literal's text as `ast.literal_eval` reads it, up to its last whole escape: an escape
    being written (`\\x4`, `\\12`, `\\N{…`) and a triple quote's trailing quotes wait for what follows."""
    if not closed:
        if len(quote) == 3:
            body = body[:len(body) - min(2, len(body) - len(body.rstrip(quote[0])))]
        escape = _OPEN_ESCAPE.search(body)
        if escape is not None:
            body = body[:escape.start()]
            if (len(body) - len(body.rstrip("\\"))) % 2:  # the cut split an escaped backslash
                body = body[:-1]
    try:
        value = ast.literal_eval(quote + body + quote)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def _python(text: str) -> bool:
    """Whether the pythonic parser reads this call as Python (`ast`): else its fallback regex reads it, and
    that keeps a string's escapes as written (`in="…"`, a keyword as a key, is no Python)."""
    try:
        ast.parse(text[text.find("["):text.rfind("]") + 1], mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


FAMILIES = {
    "gemma4": Bracketed(re.compile(r"\s*call:([\w-]+)\{"), "{",
                        re.compile(r'(?P<quote><\|"\|>)(?P<body>.*?)(?P<close><\|"\|>|\Z)|(?P<open>[{\[])'
                                   r"|(?P<shut>[}\]])|(?P<sep>,)", re.DOTALL), '<|"|><|"|>', _delimited('<|"|>')),
    # Its parser reads the arguments up to the first `}`, in a string or not, and has no nesting.
    "function_gemma": Bracketed(re.compile(r"\s*call:(\w+)\{"), "{",
                                re.compile(r"(?P<quote><escape>)(?P<body>[^}]*?)(?P<close><escape>|(?=\})|\Z)"
                                           r"|(?P<open>(?!))"
                                           r"|(?P<shut>\})|(?P<sep>,)", re.DOTALL), "<escape><escape>",
                                _delimited("<escape>")),
    "pythonic": Bracketed(re.compile(r"\s*\[\s*([\w.]+)\s*\("), "[(",
                          re.compile(r"""(?P<quote>\"\"\"|'''|"|')(?P<body>(?:\\.|(?!(?P=quote)).)*?)"""
                                     r"""(?P<close>(?P=quote)|\Z)|(?P<open>[\[{(])|(?P<shut>[\]})])|(?P<sep>,)""",
                                     re.DOTALL), '""', _python_text, _python),
}


def family_of(parse: Callable[..., Any] | None) -> Bracketed | None:
    """The bracketed family a tool parser reads (by its mlx-lm module), None for the others."""
    module = getattr(parse, "__module__", None) or ""
    return FAMILIES.get(module.rsplit(".", 1)[-1]) if module.startswith("mlx_lm.tool_parsers.") else None


@dataclass
class _Scan:
    cut: int  # end of the last finished value (or of the opening brackets)
    closer: str  # what closes the brackets open at `cut`
    string: re.Match[str] | None  # the string written last at the arguments' level, if it is the value's last token
    inside: bool  # the text ends inside a string, at any level


def _scan(text: str, family: Bracketed, start: int) -> _Scan:
    """One pass over the arguments: where the last finished value ends, and the string being written."""
    stack = list(family.opened)
    level = len(stack)
    scan = _Scan(start, _closers(stack), None, False)
    for token in family.tokens.finditer(text, start):
        if token.group("quote") is not None:
            scan.inside = not token.group("close")
            scan.string = token if len(stack) == level else None
            continue
        scan.string, scan.inside = None, False
        if token.group("open") is not None:
            stack.append(token.group("open"))
        elif token.group("shut") is not None:
            stack.pop()
            if len(stack) < level:  # the arguments are closed: what follows is another call's, or junk
                scan.cut, scan.closer = token.end(), _closers(stack)
                break
        elif len(stack) == level:  # a separator between two arguments
            scan.cut, scan.closer = token.start(), _closers(stack)
    return scan


def _closers(stack: list[str]) -> str:
    return "".join(_CLOSING[bracket] for bracket in reversed(stack))


def inside_string(text: str, family: Bracketed) -> bool:
    """Whether the call's text ends inside one of its strings (the end-of-call marker there is its text)."""
    head = family.head.match(text)
    return head is not None and _scan(text, family, head.end()).inside


class BracketedReader:
    """The settled part of a bracketed call being written, as `call_text.SettledReader` reads the others:
    each reading extends the one before, and the family parser's whole call extends them all."""

    def __init__(self, family: Bracketed, parse: Callable[..., Any], tools: list[dict[str, Any]] | None,
                 arguments: Callable[[Any], str]):
        self.family, self.parse, self.tools, self._arguments = family, parse, tools, arguments
        self._finished: tuple[int, str | None] = (-1, None)  # (cut, the arguments' text through it)
        self._probed: tuple[int, str | None] = (-1, None)  # (string start, the arguments through its quote)

    def read(self, text: str) -> tuple[str, str] | None:
        head = self.family.head.match(text)
        if head is None:
            return None
        scan = _scan(text, self.family, head.end())
        prefix = self._through(text, scan.cut, scan.closer, head.end())
        if prefix is None:
            return head.group(1), ""
        string = scan.string
        if string is None or text[string.start() - 1:string.start()].isalnum():  # none, or `r"…"`, `b"…"`
            return head.group(1), prefix
        opening = self._opening(text, string.start(), scan.closer)
        if opening is None or not opening.startswith(prefix):
            return head.group(1), prefix
        value = self.family.decode(string.group("quote"), string.group("body"), bool(string.group("close")))
        if value is None:
            return head.group(1), opening
        return head.group(1), opening + json.dumps(value, ensure_ascii=False)[1:-1]

    def _through(self, text: str, cut: int, closer: str, start: int) -> str | None:
        """The arguments object's text through the value that ends at `cut`, as the family parser reads it."""
        if cut == self._finished[0]:
            return self._finished[1]
        prefix = "{" if cut == start else self._parsed(text[:cut] + closer, "}")
        self._finished = (cut, prefix)
        return prefix

    def _opening(self, text: str, at: int, closer: str) -> str | None:
        """The arguments through the opening quote of the string at `at` (its key as the parser writes it):
        the parser's reading of the call with an empty string there. None: not a string value it keeps."""
        if at != self._probed[0]:
            probe = text[:at] + self.family.empty + closer
            opening = self._parsed(probe, '""}')
            if self.family.decodes is not None and not self.family.decodes(probe):
                opening = None  # its strings are read another way: each streams once finished
            self._probed = (at, None if opening is None else opening + '"')
        return self._probed[1]

    def _parsed(self, text: str, tail: str) -> str | None:
        """The family parser's arguments of `text` less `tail` they must end with; None if it cannot read it."""
        try:
            arguments = self._arguments(self.parse(text, self.tools))
        except Exception:  # the family cannot read it (yet): nothing more streams until it can
            return None
        return arguments[:-len(tail)] if arguments.endswith(tail) else None
