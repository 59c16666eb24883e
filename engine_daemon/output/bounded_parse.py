"""mlx-lm's tool-call parsers under a time bound, so no model output can stall the batch.

A finished call is parsed on the mlx thread, between two decode steps of every stream. Most
family parsers match the call with lazy regexes (`<arg_key>(.*?)</arg_key>…(.*?)</arg_value>`),
which take quadratic or worse time on text with many openers and no closers: measured on this
VM, 40 KB of such text took GLM-4.7's parser 3.8 s, LongCat's 1.2 s and Gemma 4's over 20 s (the
openers are single tokens, so a few thousand generated tokens make them). Every stream waited.

They all match through the `regex` module, which takes a `timeout`. Each parser's module gets
its compiled patterns (and its `re`) swapped for proxies that pass the time left before a
per-thread deadline, set around one parse (`bounded`). A parse that runs out raises
TimeoutError, and the output parser treats the call as one it could not read.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import regex

log = logging.getLogger(__name__)
# Per parse. Well-formed calls parse in linear time: a 300 KB call takes a few milliseconds.
PARSE_SECONDS = 0.25
_MATCHERS = frozenset({"search", "match", "fullmatch", "findall", "finditer", "sub", "subn", "split", "splititer"})
_deadline = threading.local()


def _remaining() -> float | None:
    at = getattr(_deadline, "at", None)
    return None if at is None else max(at - time.monotonic(), 1e-6)


def _with_timeout(method: Callable[..., Any]) -> Callable[..., Any]:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", _remaining())
        return method(*args, **kwargs)
    return bounded


class _BoundedPattern:
    """A compiled `regex` pattern whose matching methods stop at the thread's deadline."""

    def __init__(self, pattern: Any):
        self._pattern = pattern

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._pattern, name)
        return _with_timeout(attribute) if name in _MATCHERS else attribute


class _BoundedRegex:
    """The `regex` module as a parser module sees it: `re.sub(…)` and `re.compile(…)` bounded too."""

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(regex, name)
        if name == "compile":
            return lambda *args, **kwargs: _BoundedPattern(regex.compile(*args, **kwargs))
        return _with_timeout(attribute) if name in _MATCHERS else attribute


_BOUNDED_REGEX = _BoundedRegex()
_bound_modules: set[str] = set()
_lock = threading.Lock()
_timed_out = 0  # parses that ran out of time, since the engine started


def timed_out() -> int:
    """Parses that ran past their bound (`/stats` `tool_parses_timed_out`)."""
    return _timed_out


def _bind(module_name: str) -> None:
    """Swaps a parser module's `regex` patterns and module for bounded ones (once per module)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None or module_name in _bound_modules:
            return
        for name, value in list(vars(module).items()):
            if isinstance(value, regex.Pattern):
                setattr(module, name, _BoundedPattern(value))
            elif value is regex:
                setattr(module, name, _BOUNDED_REGEX)
        _bound_modules.add(module_name)


def bounded(parser: Callable[..., Any], seconds: float = PARSE_SECONDS) -> Callable[..., Any]:
    """`parser` (an mlx-lm `parse_tool_call`) that raises TimeoutError rather than run past `seconds`."""
    _bind(parser.__module__)

    def parse(text: str, tools: Any = None) -> Any:
        _deadline.at = time.monotonic() + seconds
        try:
            return parser(text, tools)
        except TimeoutError:
            global _timed_out
            with _lock:
                _timed_out += 1
            log.warning("%s ran past %.2f s on a %d-character tool call: read as malformed", parser.__module__,
                        seconds, len(text))
            raise
        finally:
            _deadline.at = None
    parse.__module__ = parser.__module__
    return parse
