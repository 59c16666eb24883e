"""How deep a client's JSON may nest, and JSON text inside strings (tool-call arguments) the engine can read.

Why a limit of its own: the JSON parsers give up near Python's recursion limit (~1,000 levels)
with a bare "nested too deeply", and what gets past them broke later, with texts that named
nothing: the chat template renders tool-call arguments and tool schemas with `tojson` and failed
from ~500 levels ("The chat template rejected the messages: maximum recursion depth exceeded in
comparison"), and the engine's `json.loads` of an `arguments` string 100,000 levels deep failed the
same way. No client needs more than a few dozen levels, so past `MAX_NESTING` a body (or an
arguments string) is a 400 that says how deep is allowed and where it went deeper, as a param path.

An `arguments` string is JSON the engine parses for the template (`template_messages`): a lone
UTF-16 surrogate written as an escape in it (`"\\ud800"`) is valid JSON but not text, and reached
the tokenizer as "TextEncodeInput must be Union[...]"; it is a 400 naming the call's arguments here.

Cost: a body with at most `MAX_NESTING` brackets is not looked at again; otherwise its depth is
measured in C (numpy tells brackets in strings from the others), and only a body found too
deep is walked token by token, up to where it goes too deep, to name the place.
"""

from __future__ import annotations

import json
import re

import numpy as np

from http_frontend.errors import APIError, bad_request

MAX_NESTING = 256
# A JSON string or a structural character (`path_past` walks only these; numbers and literals are skipped).
# Possessive: a 16 MB string is skipped in one run, not character by character (3.9 s against 0.35 s).
_TOKEN = re.compile(rb'"(?:[^"\\]++|\\.)*+"|[\[\]{},]', re.S)
_CHUNK = 1 << 20
# An escape of a UTF-16 surrogate (paired or not): only text holding one needs a closer look.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Path components shown in full; a deeper path is cut in the middle.
_SHOWN = 8


def max_depth(raw: bytes, limit: int = MAX_NESTING) -> int:
    """How deep arrays and objects nest in the JSON `raw` (exact for valid JSON); a fast 0 when it cannot
    pass `limit` (fewer opening brackets than that in all).

    Brackets inside strings are told apart with numpy, in 1 MB chunks: each C call is short, so
    the GIL goes back to the event loop between them. A regex cutting the strings out held it
    for 0.7 s in one call on 12 MB of small strings (its cost is per string).
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0
    deepest = depth = 0
    inside = False  # whether the chunk starts inside a string
    start = 0
    while start < len(raw):
        end = min(len(raw), start + _CHUNK)
        while end < len(raw) and raw[end - 1] == 0x5C:  # never split an escape from what it escapes
            end += 1
        chunk = np.frombuffer(raw, dtype=np.uint8, count=end - start, offset=start)
        quotes = _unescaped_quotes(chunk)
        opens = np.flatnonzero((chunk == 0x5B) | (chunk == 0x7B))
        closes = np.flatnonzero((chunk == 0x5D) | (chunk == 0x7D))
        # A bracket is structure when an even number of quotes (odd, starting inside a string) comes before it.
        opens = opens[(np.searchsorted(quotes, opens) + inside) % 2 == 0]
        closes = closes[(np.searchsorted(quotes, closes) + inside) % 2 == 0]
        if opens.size or closes.size:
            order = np.argsort(np.concatenate([opens, closes]), kind="stable")
            steps = np.concatenate([np.ones(opens.size, np.int32), -np.ones(closes.size, np.int32)])[order]
            levels = np.cumsum(steps, dtype=np.int32) + depth
            deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        inside = bool((quotes.size + inside) % 2)
        start = end
    return deepest


def _unescaped_quotes(chunk: np.ndarray) -> np.ndarray:
    """Positions of the `"` in `chunk` that open or close a string: not after an odd run of backslashes."""
    quotes = np.flatnonzero(chunk == 0x22)
    slashes = np.flatnonzero(chunk == 0x5C)
    if not quotes.size or not slashes.size:
        return quotes
    starts = np.ones(slashes.size, dtype=bool)
    starts[1:] = slashes[1:] != slashes[:-1] + 1
    run_start = np.maximum.accumulate(np.where(starts, slashes, 0))  # where each backslash's run began
    before = np.maximum(np.searchsorted(slashes, quotes) - 1, 0)  # the last backslash before each quote
    run = np.where((slashes[before] == quotes - 1), quotes - run_start[before], 0)
    return quotes[run % 2 == 0]


def path_past(raw: bytes, limit: int = MAX_NESTING) -> list[str | int]:
    """The path (keys and indices) to the first array or object of `raw` nested deeper than `limit`.

    Walks tokens only as far as that point; the JSON after it is never read, so this works
    on a body the parsers refused for its depth.
    """
    stack: list[list] = []  # per open container: [is_object, key or index, expecting a key]
    for match in _TOKEN.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            if len(stack) >= limit:
                return [entry[1] for entry in stack]
            if stack and stack[-1][0]:
                stack[-1][2] = False
            stack.append([token == b"{", None if token == b"{" else 0, token == b"{"])
        elif token in (b"]", b"}"):
            if stack:
                stack.pop()
        elif token == b",":
            if stack and stack[-1][0]:
                stack[-1][2] = True
            elif stack:
                stack[-1][1] += 1
        elif stack and stack[-1][0] and stack[-1][2]:  # a key
            stack[-1][1], stack[-1][2] = _key(token), False
    return [entry[1] for entry in stack]


def _key(token: bytes) -> str:
    try:
        text = json.loads(token)
    except ValueError:
        text = token[1:-1].decode("utf-8", "replace")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def show_path(path: list[str | int], prefix: str = "") -> str:
    """A param path in the chat route's style (`messages.[1].content`), its middle cut when it is long."""
    parts = [f"[{part}]" if isinstance(part, int) else str(part) for part in path]
    if len(parts) > _SHOWN + 2:
        parts = parts[:_SHOWN] + [f"…({len(parts) - _SHOWN - 2} more levels)…"] + parts[-2:]
    return ".".join(([prefix] if prefix else []) + parts) or "(the body)"


def too_deep(where: str, limit: int = MAX_NESTING, inside: str = "the request body",
             code: str = "invalid_json") -> APIError:
    return bad_request(f"Invalid '{where}': {inside} nests arrays and objects more than {limit} levels deep "
                       f"there; at most {limit} levels are allowed", param=where, code=code)


def body_too_deep(raw: bytes, limit: int = MAX_NESTING) -> APIError:
    """The 400 for a body that nests past `limit` (the parsers refused it, or `check_body_depth` did)."""
    return too_deep(show_path(path_past(raw, limit)), limit)


def check_body_depth(raw: bytes, limit: int = MAX_NESTING) -> None:
    """400 naming where a parsed body nests past `limit`."""
    if max_depth(raw, limit) > limit:
        raise body_too_deep(raw, limit)


def check_json_text(text: str, param: str, limit: int = MAX_NESTING) -> None:
    """A string that holds JSON the engine parses (`arguments`): 400 when its JSON nests past `limit`, or
    holds an escaped lone surrogate. Text that is not JSON is left as it is (the engine passes it on)."""
    raw = text.encode("utf-8", "surrogatepass")
    if max_depth(raw, limit) > limit:
        inner = show_path(path_past(raw, limit))
        raise too_deep(param, limit, f"its JSON (at '{inner}')", code="invalid_value")
    if not _SURROGATE_ESCAPE.search(text):
        return
    try:
        json.dumps(json.loads(text), ensure_ascii=False).encode("utf-8")  # its depth is within the limit
    except UnicodeEncodeError as exc:
        escape = f"\\u{ord(exc.object[exc.start]):04x}"
        raise bad_request(f"Invalid '{param}': its JSON holds the escape '{escape}', a lone UTF-16 surrogate, "
                          "which is not valid Unicode (a surrogate escape must be a high one, \\ud800-\\udbff, "
                          "followed by a low one, \\udc00-\\udfff)", param=param, code="invalid_value") from None
    except ValueError:
        return  # not JSON: the engine passes it on as text
