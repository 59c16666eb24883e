"""Reading JSON bodies and typed fields, with 400s that name the offending `param`.

A body is refused at once when the engine could never receive it: a string with a lone
UTF-16 surrogate (JSON allows `"\\ud800"`, UTF-8 and msgpack do not) or an integer outside
64 bits, anywhere in it. Bodies over `OFF_LOOP_BYTES` are parsed and checked in one parser
thread per worker, one body at a time: the C JSON parser holds the GIL while it runs, so the
event loop gets its turn between bodies (heartbeats, other streams) however many arrive at
once, and only one large body is being turned into objects at a time. The cyclic garbage
collector is paused while a body is parsed (`collector_paused`): a body of a million small
arrays otherwise sets off full collections that walk every object made so far, which
tripled the time the parser held the GIL (1.3 s against 0.4 s for 13 MB of `[[1,[2]],...]`).
A body nested past `MAX_NESTING` levels is a 400 naming where (`json_limits`).
A body is decoded with msgspec first, `json.loads` only for what msgspec refuses (`decoded`), and
checked with msgspec's packer (`check_encodable`): each C call holds the GIL for its whole length,
and 13 MB of token ids held it 0.66 s in `json.loads` and 0.14 s in `msgpack.packb` against 0.12 s
and 0.02 s.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import falcon.asgi
import msgspec

from http_frontend.errors import APIError, bad_request
from http_frontend.parsing.json_limits import body_too_deep, check_body_depth, show_path
from protocol.codec import pack

MAX_BODY_BYTES = 16 * 1024 * 1024
OFF_LOOP_BYTES = 1024 * 1024
_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="json-body")
# The engine's limit on model and adapter names (`engine_daemon.config.MAX_NAME_BYTES`): the front-end
# never imports the daemon, so the number is repeated here.
MAX_MODEL_NAME_BYTES = 255
T = TypeVar("T")

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object"}


async def read_json_object(req: falcon.asgi.Request, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 / 413 that says what is wrong."""
    if req.content_length is not None and req.content_length > max_bytes:
        raise APIError(413, f"Request body exceeds {max_bytes} bytes", code="request_too_large")
    # One byte past the limit is enough to refuse: a chunked body without a length is never
    # buffered whole.
    raw = await req.stream.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise APIError(413, f"Request body exceeds {max_bytes} bytes", code="request_too_large")
    if not raw.strip():
        raise bad_request("The request body is empty; a JSON object is required", code="invalid_json")
    if len(raw) > OFF_LOOP_BYTES:
        body = await asyncio.get_running_loop().run_in_executor(_PARSER, parse_json_object, raw)
    else:
        body = parse_json_object(raw)
    req.context.end_user = end_user_of(body)
    cache_key = body.get("prompt_cache_key")  # OpenAI's cache hint: the router keeps its requests on one engine
    req.context.prompt_cache_key = cache_key[:256] if isinstance(cache_key, str) and cache_key else None
    return body


async def off_loop(call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` in the parser thread: a walk over a large parsed body (millions of token ids) off the loop."""
    return await asyncio.get_running_loop().run_in_executor(_PARSER, call, *args)


def end_user_of(body: dict[str, Any]) -> str | None:
    """The end user a client names (OpenAI `user`, Anthropic `metadata.user_id`): without API keys, the
    engine shares decode slots between these (`client` in the ADD)."""
    metadata = body.get("metadata")
    user = body.get("user") or (metadata.get("user_id") if isinstance(metadata, dict) else None)
    return user[:64] if isinstance(user, str) and user else None


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection meanwhile: a parse makes only new, acyclic containers, so a collection during it
    finds nothing to free and walks every object made so far. The one after it runs once, in one generation."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object whose every value msgpack can carry, or a 400 that says what is wrong."""
    try:
        with collector_paused():
            body = decoded(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise body_too_deep(raw) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    check_body_depth(raw)
    check_encodable(body)
    return body


def decoded(raw: bytes) -> Any:
    """`raw` parsed by msgspec, or by `json.loads` where msgspec refuses it.

    msgspec is strict RFC 8259 and gives what `json.loads` gives for such input (last duplicate key
    wins, integers of any size); what it refuses (`NaN`, `1e400`, UTF-16 or a BOM, a surrogate in the
    raw UTF-8, malformed JSON, deep nesting) goes through `json.loads`, so every body gets the value or
    the error message it always got.
    """
    try:
        return msgspec.json.decode(raw)
    except (msgspec.MsgspecError, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return json.loads(raw)


def check_encodable(body: dict[str, Any]) -> None:
    """400 naming the place (a param path) of a lone surrogate or an integer outside 64 bits.

    msgspec packs the whole body in C (a fraction of what parsing it cost) and refuses exactly the
    integers and strings msgpack refuses. Its packer has no nesting limit where msgpack's is 1,024
    levels, but no body nests past `MAX_NESTING` (`check_body_depth`). Only a refused body is
    walked again, value by value, to name the culprit: "'messages'" alone left a client to search
    a conversation for one bad escape.
    """
    try:
        pack(body)  # the engine's frames are packed so (`protocol.encode`)
        return
    except (OverflowError, UnicodeEncodeError, ValueError):
        pass
    found = _culprit(body)
    if found is None:
        raise bad_request("The request body holds a value that cannot be sent to the engine", code="invalid_value")
    path, problem, is_key = found
    where = _printable(show_path(path))
    raise bad_request(f"Invalid {'field name' if is_key else 'value for'} '{where}': {problem}", param=where,
                      code="invalid_value")


def _culprit(body: dict[str, Any]) -> tuple[list[str | int], str, bool] | None:
    """The path to the first key or value msgpack refuses (in document order), what is wrong, and whether
    it is a key. Iterative, a body may nest `MAX_NESTING` levels; each pending value holds its path as a
    link to its parent's, not a copy (a wide array deep down would copy the path once per item)."""
    Link = tuple[Any, Any] | None  # (parent link, key or index)

    def unlinked(link: Link) -> list[str | int]:
        parts: list[str | int] = []
        while link is not None:
            link, part = link
            parts.append(part)
        return parts[::-1]

    stack: list[tuple[Any, Link]] = [(body, None)]
    while stack:
        node, link = stack.pop()
        if isinstance(node, dict):
            for key in node:
                problem = _scalar_problem(key)
                if problem:
                    return unlinked((link, key)), problem, True
            stack.extend((node[key], (link, key)) for key in reversed(list(node)))
        elif isinstance(node, list):
            stack.extend((node[index], (link, index)) for index in range(len(node) - 1, -1, -1))
        else:
            problem = _scalar_problem(node)
            if problem:
                return unlinked(link), problem, False
    return None


def _scalar_problem(value: Any) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"a string holds a lone UTF-16 surrogate ('\\u{ord(value[exc.start]):04x}'), which is not "
                    "valid Unicode")
    elif isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return "an integer is outside the 64-bit range"
    return None


def _printable(text: str) -> str:
    """`text` safe to echo in a JSON answer (a lone surrogate escaped)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_model_name(model: Any) -> None:
    """The engine refuses longer names too; refused here, its 400 comes before any engine work."""
    if isinstance(model, str) and len(model.encode("utf-8", "surrogatepass")) > MAX_MODEL_NAME_BYTES:
        raise bad_request(f"Invalid 'model': model names are limited to {MAX_MODEL_NAME_BYTES} bytes", param="model",
                          code="invalid_model_name")


def one_of(value: Any, names: Collection[str]) -> bool:
    """Whether a client's `value` is one of `names`: a string first, since a list or a map sent where a name
    belongs is unhashable, and a lookup in a set or dict of names would raise (a 500) instead of answering no."""
    return isinstance(value, str) and value in names


def _describe(types: tuple[type, ...]) -> str:
    return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)


def get_field(body: dict[str, Any], name: str, types: tuple[type, ...], *, required: bool = False,
              default: Any = None, minimum: float | None = None, maximum: float | None = None) -> Any:
    """A typed field (null counts as absent); int is accepted where a float is asked, bool never."""
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"Missing required parameter: '{name}'", param=name, code="missing_required_parameter")
        return default
    accepted = types + ((int,) if float in types else ())
    if isinstance(value, bool) and bool not in types or not isinstance(value, accepted):
        raise bad_request(f"Invalid type for '{name}': expected {_describe(types)}, got {type(value).__name__}",
                          param=name, code="invalid_type")
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
        # msgpack carries 64-bit integers: a bigger one could never reach the engine.
        raise bad_request(f"Invalid value for '{name}': {value} is out of the 64-bit integer range", param=name)
    if minimum is not None and value < minimum:
        raise bad_request(f"Invalid value for '{name}': {value} is less than the minimum of {minimum}", param=name)
    if maximum is not None and value > maximum:
        raise bad_request(f"Invalid value for '{name}': {value} is greater than the maximum of {maximum}",
                          param=name)
    return value
