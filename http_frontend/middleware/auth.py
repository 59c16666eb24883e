"""API keys, the admin role and CORS: the front-end's falcon middleware for who may call it.

Keys are checked in `process_request`, before routing, so an unknown route, a
large body or a call that would reach the engine costs an unauthenticated client
nothing but a 401. Only `GET /health` (for load balancers and orchestrators) and
CORS preflights (browsers never send credentials on them) are public.

Two roles: ordinary keys (`--api-key`) use the model; admin keys (`--admin-api-key`) may also
change what every client shares — unload the model, register or remove adapters — where an
ordinary key gets 403. Each request learns its `Caller`: a short digest of its key (never the key)
that stored Responses are owned by and that the engine shares decode slots by.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import falcon
import falcon.asgi

from http_frontend.errors import APIError
from http_frontend.settings import FrontendSettings

log = logging.getLogger(__name__)

PUBLIC_ROUTES = {("GET", "/health"), ("HEAD", "/health")}
# Resources whose responders change what every client shares (unload, adapters) name the methods
# that need the admin role in this attribute, e.g. `Unload.admin_methods`.
ADMIN_METHODS_ATTRIBUTE = "admin_methods"
# Resources anyone may read without a key name their methods here: the playground's page and files,
# which hold no data (everything the page then fetches needs a key as usual).
PUBLIC_METHODS_ATTRIBUTE = "public_methods"
# Only requests for these paths wait for routing to learn whether their resource is public; every
# other keyless request is refused before routing, as before.
PAGE_PATHS = ("/", "/playground")
PAGE_PREFIX = "/playground/"


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: `client` is a digest of its key (None without keys), `admin` its role."""

    client: str | None
    admin: bool


OPEN = Caller(client=None, admin=True)  # no keys configured: everyone may do everything


def caller_of(req: falcon.asgi.Request) -> Caller:
    return getattr(req.context, "caller", None) or OPEN


def needs_admin(req: falcon.asgi.Request, resource: object) -> bool:
    """Decided on the resource the router chose, never on how the path is spelled: falcon routes
    `//unload` to `Unload` as well, so a pattern on `req.path` could be walked around."""
    return req.method in getattr(resource, ADMIN_METHODS_ATTRIBUTE, ())


def may_be_public_page(req: falcon.asgi.Request) -> bool:
    """A keyless GET/HEAD of the playground's paths: decided once routed, on the resource (`is_public_resource`)."""
    return req.method in ("GET", "HEAD") and (req.path in PAGE_PATHS or req.path.startswith(PAGE_PREFIX))


def is_public_resource(req: falcon.asgi.Request, resource: object) -> bool:
    return req.method in getattr(resource, PUBLIC_METHODS_ATTRIBUTE, ())


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
    """Rejects every request without a configured key, except the public ones; admin routes need an admin key."""

    def __init__(self, keys: Iterable[str], admin_keys: Iterable[str] = ()):
        self._digests = tuple(_digest(key) for key in keys)
        self._admin_digests = tuple(_digest(key) for key in admin_keys)
        if not self._digests and not self._admin_digests:
            raise ValueError("APIKeyAuth needs at least one key")

    @staticmethod
    def _found(given: bytes, digests: tuple[bytes, ...]) -> bool:
        """Constant time: every configured key is compared, whatever matched first."""
        found = False
        for digest in digests:
            found |= hmac.compare_digest(given, digest)
        return found

    def matches(self, candidate: str) -> bool:
        given = _digest(candidate)
        return self._found(given, self._digests) | self._found(given, self._admin_digests)

    @staticmethod
    def is_public(req: falcon.asgi.Request) -> bool:
        if (req.method, req.path) in PUBLIC_ROUTES:
            return True
        return req.method == "OPTIONS" and req.get_header("Access-Control-Request-Method") is not None

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.is_public(req):
            candidate = presented_key(req)
            if candidate is not None and self.matches(candidate):
                given = _digest(candidate)
                req.context.caller = Caller(client=given.hex()[:16], admin=self._found(given, self._admin_digests))
            else:
                req.context.anonymous = True  # a public route without a key: `Health` answers its status only
            return
        candidate = presented_key(req)
        if candidate is None:
            if may_be_public_page(req):
                req.context.key_deferred = True  # checked in process_resource, on the routed resource
                return
            raise unauthorized("Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        given = _digest(candidate)
        admin = self._found(given, self._admin_digests)
        if not (self._found(given, self._digests) | admin):
            raise unauthorized("Incorrect API key provided")
        req.context.caller = Caller(client=given.hex()[:16], admin=admin)

    async def process_resource(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, resource: object,
                               params: dict[str, object]) -> None:
        """After routing, before the responder (and before the body is read): public pages, the admin role's routes.

        Decided on the resource the router chose, never on how the path is spelled, as `needs_admin`.
        """
        if getattr(req.context, "key_deferred", False) and not is_public_resource(req, resource):
            raise unauthorized("Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        caller = getattr(req.context, "caller", None)
        if needs_admin(req, resource) and not (caller is not None and caller.admin):
            raise APIError(403, "This route needs an admin key (--admin-api-key)", code="admin_key_required",
                           error_type="permission_error")


def cors_middleware(origins: tuple[str, ...]) -> falcon.CORSMiddleware:
    """Falcon's CORS policy for an explicit allow-list; credentials (cookies) are never allowed.

    "*" alone allows any origin without credentials; API keys still apply to it.
    """
    allow: str | tuple[str, ...] = "*" if "*" in origins else origins
    return falcon.CORSMiddleware(allow_origins=allow, allow_credentials=None,
                                 expose_headers=["X-Request-Id", "Request-Id", "Retry-After", "X-Context-Overflow",
                                                 "X-Engine-Id"])


def security_middleware(settings: FrontendSettings) -> list[object]:
    """CORS first (its response hook also marks 401s, so browsers can read them), then keys."""
    middleware: list[object] = []
    if settings.allowed_origins:
        middleware.append(cors_middleware(settings.allowed_origins))
    if settings.api_keys or settings.admin_api_keys:
        middleware.append(APIKeyAuth(settings.api_keys, settings.admin_api_keys))
    else:
        log.info("no API key configured: every route is open to whoever can reach this address")
    return middleware
