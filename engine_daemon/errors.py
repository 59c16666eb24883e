"""Errors a request can end with, shared by every layer of the engine (a leaf: imports nothing of ours).

`RequestError` carries the HTTP-ish status and code the front-end returns, so a refusal
raised anywhere (admission, a grammar, an adapter, a CALL) reaches the client as the
same envelope. `engine_failure` wraps an unexpected exception as a 500 for one request.
"""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the engine refuses, with the status and code the client will see."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.error_type = error_type

    def to_body(self, rid: str | None) -> dict[str, Any]:
        return {"rid": rid, "status": self.status, "code": self.code, "message": str(self),
                "type": self.error_type, "param": self.param}


def engine_failure(exc: Exception) -> RequestError:
    """An unexpected exception while serving one request, as the 500 that request ends with."""
    return RequestError(500, "engine_error", f"{type(exc).__name__}: {exc}", error_type="server_error")
