"""Reading JSON bodies and typed fields, with 400s that name the offending `param`."""

from __future__ import annotations

import json
from typing import Any

import falcon.asgi

from http_frontend.errors import APIError, bad_request

MAX_BODY_BYTES = 16 * 1024 * 1024

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
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    return body


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
