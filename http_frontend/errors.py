"""One error envelope everywhere: `{"error": {"message", "type", "param", "code"}}`.

Anthropic routes (/v1/messages...) answer the same errors in Anthropic's shape instead.
"""

from __future__ import annotations

import logging
from typing import Any

import falcon
import falcon.asgi

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ResponseCut(Exception):
    """A response that failed after its body started and has no way to say so but ending the connection
    without its last chunk: the client then sees a broken transfer rather than a short, whole-looking body."""


class APIError(Exception):
    """An error answered to the client in the OpenAI shape with its HTTP status."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers or {}

    @classmethod
    def from_engine(cls, body: dict[str, Any]) -> APIError:
        """An ERROR frame from the engine, as the client will see it."""
        headers = {"Retry-After": "1"} if body["status"] in (429, 503) else None
        return cls(body["status"], body["message"], code=body.get("code"), param=body.get("param"),
                   error_type=body.get("type"), headers=headers)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# Anthropic's error types by status (its routes answer `{"type": "error", "error": {"type", "message"}}`).
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Routes whose clients (the Anthropic SDKs) parse errors in Anthropic's shape, with or without /v1.
ANTHROPIC_PATHS = ("/v1/messages", "/messages")


def is_anthropic_path(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in ANTHROPIC_PATHS)


def speaks_anthropic(req: falcon.asgi.Request) -> bool:
    """Whether the caller parses Anthropic's shapes: its routes, or any route asked with `anthropic-version`.

    Anthropic's SDKs and agents send that header on every request (GET /v1/models too).
    """
    return is_anthropic_path(req.path) or req.get_header("anthropic-version") is not None


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """`error` in the Anthropic envelope: the type follows the status, as Anthropic's API does."""
    default = "invalid_request_error" if error.status < 500 else "api_error"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPE_BY_STATUS.get(error.status, default),
                                       "message": error.message}}


def _write(req: falcon.asgi.Request, resp: falcon.asgi.Response, error: APIError) -> None:
    resp.status = error.status
    resp.media = anthropic_error_body(error) if speaks_anthropic(req) else error.to_dict()
    for name, value in error.headers.items():
        resp.set_header(name, value)


async def handle_api_error(req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: APIError,
                           params: dict[str, Any]) -> None:
    _write(req, resp, ex)


async def handle_http_error(req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: falcon.HTTPError,
                            params: dict[str, Any]) -> None:
    """Falcon's own errors (unknown route, wrong method, bad media) in the OpenAI shape."""
    status = ex.status_code
    if isinstance(ex, falcon.HTTPRouteNotFound) or status == 404:
        error = APIError(404, f"Unknown route: {req.method} {req.path}", code="not_found")
    elif status == 405:
        error = APIError(405, f"Method {req.method} is not allowed on {req.path}", code="method_not_allowed")
    else:
        error = APIError(status, ex.description or ex.title or "HTTP error", code=None)
    _write(req, resp, error)
    for name, value in (ex.headers or {}).items():
        resp.set_header(name, value)


async def handle_unexpected(req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: Exception,
                            params: dict[str, Any]) -> None:
    log.exception("unhandled error on %s %s", req.method, req.path)
    _write(req, resp, APIError(500, f"Internal server error: {type(ex).__name__}", code="internal_error"))


def install(app: falcon.asgi.App) -> None:
    # Falcon picks the most specific handler for an exception's type.
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(falcon.HTTPError, handle_http_error)
    app.add_error_handler(APIError, handle_api_error)
