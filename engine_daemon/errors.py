"""Errors a request can end with, shared by every layer of the engine (a leaf: imports nothing of ours).

`RequestError` carries the HTTP-ish status and code the front-end returns, so a refusal
raised anywhere (admission, a grammar, an adapter, a CALL) reaches the client as the
same envelope. `engine_failure` wraps an unexpected exception as a 500 for one request.
"""

from __future__ import annotations

import re
from typing import Any

# An absolute path of two or more components inside a message (a library's exception text
# often carries one: `Qwen2Tokenizer(name_or_path='/srv/models/...')`).
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s'\"(),:;/]+/)+([^\s'\"(),:;/]*)")


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


# A clean stop (SIGTERM): what every request and CALL still open or waiting hears (`scheduling.inbox`,
# the admission pool's `Preprocessor.close`).
SHUTTING_DOWN = RequestError(503, "engine_shutting_down", "The engine is shutting down; retry the request",
                             error_type="server_error")


def describe(exc: BaseException) -> str:
    """An exception's text as a client may see it: server paths cut down to their last component."""
    return redact_paths(str(exc))


def redact_paths(text: str) -> str:
    return _ABSOLUTE_PATH.sub(lambda match: match.group(1) or "<path>", text)


def engine_failure(exc: Exception) -> RequestError:
    """An unexpected exception while serving one request, as the 500 that request ends with."""
    return RequestError(500, "engine_error", f"{type(exc).__name__}: {describe(exc)}", error_type="server_error")


def clipped(text: Any, limit: int = 64) -> str:
    """A client-controlled string as a log line may quote it: its first `limit` characters, and its length
    when cut (a 1 MB request id written into every log line filled the disk)."""
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= limit else f"{text[:limit]}…({len(text)} chars)"
