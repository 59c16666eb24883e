"""GET / and /playground (the page) and /playground/{name} (its scripts and styles).

The files are read once from package data when the app is built, so a request never
touches the disk and a name outside that fixed set is a plain 404 (no path traversal to
guard against). Every answer carries a strict Content-Security-Policy: scripts, styles and
connections only from this origin, no inline code, no framing, so even a rendering bug that let
model output into the DOM as markup could not run it or send anything elsewhere. The page holds
no data, so it is served without an API key (`public_methods`, read by the auth middleware);
everything it fetches still needs one.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from importlib import resources

import falcon
import falcon.asgi

log = logging.getLogger(__name__)

PAGE = "index.html"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# data:/blob: images and audio: previews of attachments the user picked (they become data: URIs anyway).
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data: blob:; media-src 'self' data: blob:; object-src 'none'; base-uri 'none'; "
       "form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    # Revalidate every time (cheap: ETag), so an upgraded server never runs yesterday's script.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets() -> dict[str, Asset]:
    """Every file of `static/` with a known type, by name."""
    assets = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if not entry.is_file() or suffix not in CONTENT_TYPES:
            continue
        body = entry.read_bytes()
        assets[entry.name] = Asset(body, CONTENT_TYPES[suffix], hashlib.sha256(body).hexdigest()[:20])
    if PAGE not in assets:
        raise RuntimeError("the playground's index.html is missing from the package")
    return assets


def _send(req: falcon.asgi.Request, resp: falcon.asgi.Response, asset: Asset) -> None:
    resp.set_headers(SECURITY_HEADERS)
    resp.content_type = asset.content_type
    resp.etag = asset.etag
    tags = req.if_none_match or ()
    if asset.etag in tags or "*" in tags:
        resp.status = falcon.HTTP_304
        return
    if req.method == "HEAD":
        resp.content_length = len(asset.body)
        return
    resp.data = asset.body


class PlaygroundPage:
    """The page itself, at / and /playground."""

    public_methods = frozenset({"GET", "HEAD"})  # no API key needed (`APIKeyAuth.process_resource`)

    def __init__(self, assets: dict[str, Asset]):
        self.asset = assets[PAGE]

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        _send(req, resp, self.asset)

    on_head = on_get


class PlaygroundAsset:
    """/playground/{name}: one of the page's files."""

    public_methods = frozenset({"GET", "HEAD"})

    def __init__(self, assets: dict[str, Asset]):
        self.assets = assets

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, name: str) -> None:
        asset = self.assets.get(name)
        if asset is None:
            raise falcon.HTTPNotFound()
        _send(req, resp, asset)

    on_head = on_get


def add_playground(app: falcon.asgi.App) -> None:
    """Route the page and its files (called by `create_app` unless --no-playground)."""
    assets = load_assets()
    page = PlaygroundPage(assets)
    app.add_route("/", page)
    app.add_route("/playground", page)
    app.add_route("/playground/{name}", PlaygroundAsset(assets))
    log.debug("playground: %d files, %d bytes", len(assets), sum(len(a.body) for a in assets.values()))
