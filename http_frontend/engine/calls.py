"""CALLs from a route to the engine, their failures answered as HTTP errors.

A CALL is the protocol's request/reply (`CallMethod`): the catalogue, status and
stats, tokenizing, the adapter registry, the Responses store. A route awaits the
RESULT; when the engine is unreachable the client gets a 503 it may retry, when
the engine refuses, the engine's own status, code and message, and when the
arguments cannot be packed into a frame, a 413 or 400 (`UnsendableRequest.api_error`).
"""

from __future__ import annotations

from typing import Any

from http_frontend.engine.client import EngineError, EngineLink, EngineUnavailable
from http_frontend.engine.frames import UnsendableRequest
from http_frontend.errors import APIError
from protocol import CallMethod

# (De)tokenizing runs on the engine's admission pool, queued behind other requests' prompts being rendered.
TOKENIZE_TIMEOUT = 60.0


async def call_engine(client: EngineLink, method: CallMethod, timeout: float = 5.0,
                      args: dict[str, Any] | None = None, engine: str | None = None) -> Any:
    """A CALL whose failures come back as APIError: 503 when unreachable, the engine's own error otherwise.

    `engine` names one engine of an `EnginePool` (default: the pool's first routable one).
    """
    try:
        if engine is not None:
            return await client.call(method, args, timeout=timeout, engine=engine)
        return await client.call(method, args, timeout=timeout)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "1"}) from None
    except EngineError as exc:
        raise APIError.from_engine(exc.body) from None
    except UnsendableRequest as exc:
        raise exc.api_error() from None
