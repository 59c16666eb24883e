"""Images and audio in chat messages: checked, and http(s) images fetched, by the front-end.

The engine never does network I/O: the front-end turns every `image_url` / `input_image` /
`input_audio` part into bytes and sends them in the ADD's `media` list (msgpack bin),
leaving a placeholder in the message text where the part was, so the engine keeps the
order of text and images when it renders the chat template:

    media: [{"type": "image", "data": <bytes>, "placeholder": "<|media:1f9c…:0|>",
             "format": "PNG", "resize_shape": [h, w]?},
            {"type": "audio", "data": <bytes>, "placeholder": "…", "format": "wav" | "mp3"}]

A placeholder holds a per-request random nonce, so text a client types can never pose as
one. Fetching is guarded because the URL comes from any client: http/https only (on every
redirect hop too), a byte cap (checked on Content-Length and while reading), an
image/* content type, a deadline for the whole fetch, and no connections to loopback,
private, link-local or otherwise non-public addresses unless `--allow-private-image-urls`.
The address checked is the address connected to (the connection is pinned to it), so a
DNS answer that changes between check and connect cannot slip through. Everything a
client can get wrong is a 400 naming the offending part.

Decoding here is a header check with Pillow (format, size, `verify()`); the engine
decodes the pixels (and applies EXIF orientation) itself.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import secrets
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

from http_frontend.errors import APIError, bad_request
from http_frontend.settings import FrontendSettings
from protocol.messages import MAX_FRAME_BYTES

# Pillow format names accepted (the engine accepts the same set).
IMAGE_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"})
AUDIO_FORMATS = ("wav", "mp3")
IMAGE_PART_TYPES = ("image_url", "input_image")
AUDIO_PART_TYPES = ("input_audio",)
# Decoded size beyond which an image is refused unseen (the engine applies the same ceiling).
MAX_IMAGE_PIXELS = 50_000_000
MAX_MEDIA_ITEMS = 32
MAX_REDIRECTS = 3
MAX_RESIZE_SIDE = 8192
# All media of one request must fit in one ADD frame, with room for the rest of the request.
MAX_TOTAL_MEDIA_BYTES = MAX_FRAME_BYTES - 2 * 1024 * 1024
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
DEFAULT_PORTS = {"http": 80, "https": 443}
# A translated part (Anthropic's image block) names itself as its client spelled it: errors then point at
# `messages.0.content.1`, not at the index of the OpenAI message it became (a system prompt shifts them).
SOURCE_PARAM = "_source_param"


def _error(message: str, param: str, code: str) -> APIError:
    return bad_request(message, param=param, code=code)


def parse_resize_shape(body: dict[str, Any]) -> list[int] | None:
    """mlx-vlm's per-request `resize_shape`: [size] or [height, width] (positive ints)."""
    value = body.get("resize_shape")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) not in (1, 2)
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_RESIZE_SIDE for v in value)):
        raise _error(f"Invalid 'resize_shape': expected [size] or [height, width], integers in 1..{MAX_RESIZE_SIDE}",
                     "resize_shape", "invalid_value")
    return list(value)


# Prefixes that reach IPv4 (or anything) through a translator or a relay: an address in one of them
# can stand for a private host, whatever `ipaddress` thinks of the prefix itself.
TRANSLATION_PREFIXES = tuple(ipaddress.ip_network(prefix) for prefix in (
    "64:ff9b::/96",    # NAT64, well-known prefix (RFC 6052)
    "64:ff9b:1::/48",  # NAT64, local-use prefix (RFC 8215)
    "::/96",           # IPv4-compatible IPv6 (deprecated)
    "::ffff:0:0/96",   # IPv4-mapped IPv6
    "2002::/16",       # 6to4
    "100.64.0.0/10",   # carrier-grade NAT (shared address space)
))


def is_public_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A global unicast address that no translation prefix can point back inside (the SSRF fence).

    Only `ipaddress`'s global unicast passes: not loopback, private, link-local, multicast,
    reserved, shared (CGNAT), and not any NAT64 / 6to4 / IPv4-mapped or -compatible form.
    """
    if any(address in network for network in TRANSLATION_PREFIXES if network.version == address.version):
        return False
    return address.is_global and not address.is_multicast


def check_image_bytes(data: bytes, param: str) -> str:
    """The Pillow format of an image, or a 400: undecodable, unsupported format, too many pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = image.format
            if fmt not in IMAGE_FORMATS:
                raise _error(f"Unsupported image format {fmt or 'unknown'} in '{param}'; send one of "
                             f"{', '.join(sorted(IMAGE_FORMATS - {'MPO'}))}", param, "unsupported_image_format")
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise _error(f"The image in '{param}' has {image.width}x{image.height} pixels; the limit is "
                             f"{MAX_IMAGE_PIXELS}", param, "image_too_large")
            image.verify()
    except APIError:
        raise
    except UnidentifiedImageError:
        raise _error(f"The image in '{param}' could not be decoded: not an image in a known format", param,
                     "invalid_image") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise _error(f"The image in '{param}' could not be decoded: {exc}", param, "invalid_image") from None
    return fmt


def audio_format_of(data: bytes) -> str | None:
    """"wav" or "mp3" from the first bytes (RIFF/WAVE header; ID3 tag or MPEG frame sync), else None."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


@dataclass
class _Item:
    kind: str  # "image" | "audio"
    placeholder: str
    param: str
    data: bytes | None = None
    url: str | None = None
    format: str | None = None


class MediaCollector:
    """Collects the media parts of one request's messages, then resolves them into ADD `media` items.

    `add_part` runs while messages are parsed (synchronously) and returns the placeholder
    to put in the message text; `resolve` does the fetching (concurrently) and checking.
    """

    def __init__(self, settings: FrontendSettings, resize_shape: list[int] | None = None):
        self.settings = settings
        self.resize_shape = resize_shape
        self._nonce = secrets.token_hex(8)
        self._items: list[_Item] = []

    @classmethod
    def for_request(cls, body: dict[str, Any], settings: FrontendSettings) -> MediaCollector:
        return cls(settings, parse_resize_shape(body))

    def __len__(self) -> int:
        return len(self._items)

    # -- parsing --------------------------------------------------------------------------
    def add_part(self, part: dict[str, Any], param: str, role: str) -> str:
        """Registers an image/audio content part; returns its placeholder for the message text."""
        kind = "image" if part["type"] in IMAGE_PART_TYPES else "audio"
        if isinstance(part.get(SOURCE_PARAM), str):
            param = part[SOURCE_PARAM]
        if role != "user":
            raise _error(f"'{param}': {part['type']} parts are only allowed in user messages", param,
                         "invalid_value")
        if len(self._items) >= MAX_MEDIA_ITEMS:
            raise _error(f"A request may carry at most {MAX_MEDIA_ITEMS} images and audio clips", param,
                         "too_many_media")
        item = _Item(kind, f"<|media:{self._nonce}:{len(self._items)}|>", param)
        if kind == "image":
            self._image(part, item)
        else:
            self._audio(part, item)
        self._items.append(item)
        return item.placeholder

    def _image(self, part: dict[str, Any], item: _Item) -> None:
        source = part.get("image_url")
        if isinstance(source, dict):
            source = source.get("url")
        if not isinstance(source, str) or not source:
            raise _error(f"'{item.param}': an {part['type']} part needs an image URL ('image_url.url' or "
                         "'image_url' as a string)", item.param, "invalid_type")
        scheme = source.split(":", 1)[0].lower() if ":" in source else ""
        if scheme == "data":
            item.data = self._data_url(source, item.param)
            item.format = check_image_bytes(item.data, item.param)
        elif scheme in ("http", "https"):
            item.url = source
        else:
            raise _error(f"'{item.param}': image URLs must be http(s) URLs or data: URLs, got "
                         f"{(scheme + ':') if scheme else 'no scheme'}", item.param, "invalid_image_url")

    def _data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        media_type = header.split(";", 1)[0].strip().lower()
        if not sep or not header.lower().endswith(";base64"):
            raise _error(f"'{param}': a data: URL must look like data:image/png;base64,<data>", param,
                         "invalid_image_url")
        if media_type and not media_type.startswith("image/"):
            raise _error(f"'{param}': the data: URL holds {media_type}, not an image", param,
                         "unsupported_image_format")
        return self._base64(payload, param)

    def _base64(self, payload: str, param: str) -> bytes:
        limit = self.settings.max_image_bytes
        if len(payload) * 3 // 4 > limit + 3:
            raise _error(f"The media in '{param}' exceeds the limit of {limit} bytes", param, "image_too_large")
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise _error(f"The media in '{param}' is not valid base64", param, "invalid_base64") from None
        if len(data) > limit:
            raise _error(f"The media in '{param}' exceeds the limit of {limit} bytes", param, "image_too_large")
        if not data:
            raise _error(f"The media in '{param}' is empty", param, "invalid_image")
        return data

    def _audio(self, part: dict[str, Any], item: _Item) -> None:
        audio = part.get("input_audio")
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
            raise _error(f"'{item.param}': an input_audio part needs 'input_audio': {{'data': <base64>, "
                         "'format': 'wav' | 'mp3'}}", item.param, "invalid_type")
        declared = audio.get("format")
        if declared not in AUDIO_FORMATS:
            raise _error(f"'{item.param}': input_audio format must be one of {list(AUDIO_FORMATS)}, got "
                         f"{declared!r}", item.param, "unsupported_audio_format")
        item.data = self._base64(audio["data"], item.param)
        if audio_format_of(item.data) != declared:
            raise _error(f"'{item.param}': the audio data is not {declared}", item.param, "invalid_audio")
        item.format = declared

    # -- resolving ----------------------------------------------------------------------------
    async def resolve(self) -> list[dict[str, Any]] | None:
        """The ADD's `media` list (None when the request has none), URLs fetched concurrently."""
        if not self._items:
            return None
        fetches = [asyncio.ensure_future(self._fetch_image(item)) for item in self._items if item.url is not None]
        if fetches:
            try:
                done, _ = await asyncio.wait(fetches, return_when=asyncio.FIRST_EXCEPTION)
                for fetch in done:
                    if fetch.exception() is not None:
                        raise fetch.exception()
            finally:
                for fetch in fetches:  # the first failure answers the request: stop the other downloads
                    fetch.cancel()
        total = sum(len(item.data or b"") for item in self._items)
        if total > MAX_TOTAL_MEDIA_BYTES:
            raise _error(f"The request's images and audio add up to {total} bytes; the limit is "
                         f"{MAX_TOTAL_MEDIA_BYTES}", "messages", "media_too_large")
        media = []
        for item in self._items:
            entry: dict[str, Any] = {"type": item.kind, "data": item.data, "placeholder": item.placeholder,
                                     "format": item.format}
            if item.kind == "image" and self.resize_shape is not None:
                entry["resize_shape"] = self.resize_shape
            media.append(entry)
        return media

    async def _fetch_image(self, item: _Item) -> None:
        timeout = self.settings.image_fetch_timeout
        try:
            item.data = await asyncio.wait_for(self._download(item.url, item.param), timeout)
        except asyncio.TimeoutError:
            raise _error(f"Fetching the image in '{item.param}' took longer than {timeout:g} s", item.param,
                         "image_fetch_timeout") from None
        item.format = check_image_bytes(item.data, item.param)

    async def _download(self, url: str, param: str) -> bytes:
        """GET with manual redirects, each hop checked and pinned to a checked address."""
        import httpx

        limit = self.settings.max_image_bytes
        timeout = httpx.Timeout(self.settings.image_fetch_timeout)
        # trust_env=False: an HTTP(S)_PROXY from the environment would bypass the address checks.
        async with httpx.AsyncClient(follow_redirects=False, timeout=timeout, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                target = self._checked_url(url, param)
                address = await self._checked_address(target.host, target.port or DEFAULT_PORTS[target.scheme],
                                                      param)
                # identity: a compressed body would be inflated before the byte cap could see it (32 KB of
                # zstd became 2 GB in one chunk); an image format compresses itself anyway.
                headers = {"Host": target.netloc.decode("ascii"), "Accept": "image/*", "Accept-Encoding": "identity"}
                extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
                request = client.build_request("GET", target.copy_with(host=address), headers=headers,
                                               extensions=extensions)
                try:
                    response = await client.send(request, stream=True)
                except Exception as exc:  # httpx's errors, and what its socket layer lets through (an ExceptionGroup)
                    raise _error(f"The image in '{param}' could not be fetched: {type(exc).__name__}: {exc}", param,
                                 "image_fetch_failed") from None
                try:
                    if response.status_code in REDIRECT_STATUSES and "location" in response.headers:
                        url = urljoin(str(target), response.headers["location"])
                        continue
                    return await self._body(response, param, limit)
                except httpx.HTTPError as exc:  # a body cut short, a malformed chunk
                    raise _error(f"The image in '{param}' could not be read: {type(exc).__name__}", param,
                                 "image_fetch_failed") from None
                finally:
                    await response.aclose()
        raise _error(f"The image URL in '{param}' redirects more than {MAX_REDIRECTS} times", param,
                     "image_fetch_failed")

    @staticmethod
    def _checked_url(url: str, param: str) -> Any:
        import httpx

        try:
            target = httpx.URL(url)
            host = target.host  # decodes IDNA: `xn--` alone raises here
        except Exception:  # httpx raises InvalidURL, idna.IDNAError and friends
            raise _error(f"'{param}': {url[:200]!r} is not a valid URL", param, "invalid_image_url") from None
        if target.scheme not in ("http", "https") or not host:
            raise _error(f"'{param}': image URLs (and their redirects) must be http(s) URLs with a host", param,
                         "invalid_image_url")
        if target.port is not None and not 0 < target.port < 65536:
            raise _error(f"'{param}': the URL's port {target.port} is out of range", param, "invalid_image_url")
        if target.userinfo:
            raise _error(f"'{param}': image URLs may not carry credentials", param, "invalid_image_url")
        return target

    async def _checked_address(self, host: str, port: int, param: str) -> str:
        """The address to connect to: resolved once, refused when not public (unless allowed)."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError, OverflowError, ValueError) as exc:  # a port past 65535 too
            raise _error(f"The image host in '{param}' could not be resolved: {exc}", param,
                         "image_fetch_failed") from None
        addresses = [info[4][0] for info in infos]
        if not addresses:
            raise _error(f"The image host in '{param}' has no address", param, "image_fetch_failed")
        if not self.settings.allow_private_image_urls:
            for address in addresses:
                if not is_public_address(ipaddress.ip_address(address.split("%", 1)[0])):
                    raise _error(f"The image URL in '{param}' leads to a non-public address ({address}); this "
                                 "server does not fetch from those (operators: --allow-private-image-urls)", param,
                                 "image_url_not_allowed")
        return addresses[0]

    @staticmethod
    async def _body(response: Any, param: str, limit: int) -> bytes:
        if response.status_code != 200:
            raise _error(f"Fetching the image in '{param}' failed with HTTP {response.status_code}", param,
                         "image_fetch_failed")
        content_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if not content_type.startswith("image/"):
            raise _error(f"The URL in '{param}' answered with content type {content_type or 'none'}, not an image",
                         param, "unsupported_image_format")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise _error(f"The URL in '{param}' answered with Content-Encoding {encoding[:40]!r} though it was asked "
                         "for identity; compressed image bodies are not inflated", param, "image_fetch_failed")
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _error(f"The image in '{param}' is {length} bytes; the limit is {limit}", param, "image_too_large")
        data = bytearray()
        async for chunk in response.aiter_raw():  # as sent: nothing inflates past the cap
            data += chunk
            if len(data) > limit:
                raise _error(f"The image in '{param}' exceeds the limit of {limit} bytes", param, "image_too_large")
        return bytes(data)
