"""API keys and CORS: the front-end's falcon middleware for who may call it.

Keys are checked in `process_request`, before routing, so an unknown route, a
large body or a call that would reach the engine costs an unauthenticated client
nothing but a 401. Only `GET /health` (for load balancers and orchestrators) and
CORS preflights (browsers never send credentials on them) are public.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable

import falcon
import falcon.asgi

from http_frontend.errors import APIError
from http_frontend.settings import FrontendSettings

log = logging.getLogger(__name__)

PUBLIC_ROUTES = {("GET", "/health"), ("HEAD", "/health")}


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps even the key's length out of the timing.
    return hashlib.sha256(key.encode("utf-8")).digest()


def presented_key(req: falcon.asgi.Request) -> str | None:
    """The key a client sent: `Authorization: Bearer KEY` (OpenAI SDKs) or `x-api-key: KEY`."""
    authorization = req.get_header("Authorization")
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    api_key = req.get_header("X-API-Key")
    return api_key.strip() if api_key and api_key.strip() else None


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", error_type="authentication_error",
                    headers={"WWW-Authenticate": "Bearer"})


class APIKeyAuth:
    """Rejects every request without a configured key, except the public ones."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(key) for key in keys)
        if not self._digests:
            raise ValueError("APIKeyAuth needs at least one key")

    def matches(self, candidate: str) -> bool:
        """Constant time: every configured key is compared, whatever matched first."""
        given = _digest(candidate)
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(given, digest)
        return found

    @staticmethod
    def is_public(req: falcon.asgi.Request) -> bool:
        if (req.method, req.path) in PUBLIC_ROUTES:
            return True
        return req.method == "OPTIONS" and req.get_header("Access-Control-Request-Method") is not None

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.is_public(req):
            return
        candidate = presented_key(req)
        if candidate is None:
            raise unauthorized("Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        if not self.matches(candidate):
            raise unauthorized("Incorrect API key provided")


def cors_middleware(origins: tuple[str, ...]) -> falcon.CORSMiddleware:
    """Falcon's CORS policy for an explicit allow-list; credentials (cookies) are never allowed.

    "*" alone allows any origin without credentials; API keys still apply to it.
    """
    allow: str | tuple[str, ...] = "*" if "*" in origins else origins
    return falcon.CORSMiddleware(allow_origins=allow, allow_credentials=None,
                                 expose_headers=["X-Request-Id", "Retry-After", "X-Context-Overflow"])


def security_middleware(settings: FrontendSettings) -> list[object]:
    """CORS first (its response hook also marks 401s, so browsers can read them), then keys."""
    middleware: list[object] = []
    if settings.allowed_origins:
        middleware.append(cors_middleware(settings.allowed_origins))
    if settings.api_keys:
        middleware.append(APIKeyAuth(settings.api_keys))
    else:
        log.info("no API key configured: every route is open to whoever can reach this address")
    return middleware
