"""The front-end's settings, read once per worker from the environment.

`frontend` turns its flags into these variables before gunicorn forks, so workers,
HUP reloads and a plain gunicorn run with the deploy folder's config all see the same
values. Reading them in one place means a bad value fails the worker's start with
the variable's name instead of surfacing as a 500 on some later request.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

API_KEY_ENV = "MLX_ENGINE_API_KEY"
MAX_STOP_STRINGS_ENV = "MLX_FRONTEND_MAX_STOP_STRINGS"
MAX_STOP_LENGTH_ENV = "MLX_FRONTEND_MAX_STOP_LENGTH"
ADMIN_API_KEY_ENV = "MLX_FRONTEND_ADMIN_API_KEY"
ALLOWED_ORIGINS_ENV = "MLX_FRONTEND_ALLOWED_ORIGINS"
MAX_BODY_BYTES_ENV = "MLX_FRONTEND_MAX_BODY_BYTES"
MAX_MESSAGES_ENV = "MLX_FRONTEND_MAX_MESSAGES"
MAX_TOKENS_LIMIT_ENV = "MLX_FRONTEND_MAX_TOKENS_LIMIT"
MAX_PENDING_BYTES_ENV = "MLX_FRONTEND_MAX_PENDING_BYTES"
REQUEST_TIMEOUT_ENV = "MLX_FRONTEND_REQUEST_TIMEOUT"
LOG_LEVEL_ENV = "MLX_FRONTEND_LOG_LEVEL"
# Images / audio in chat messages (MediaCollector)
ALLOW_PRIVATE_IMAGE_URLS_ENV = "MLX_FRONTEND_ALLOW_PRIVATE_IMAGE_URLS"
MAX_IMAGE_BYTES_ENV = "MLX_FRONTEND_MAX_IMAGE_BYTES"
IMAGE_FETCH_TIMEOUT_ENV = "MLX_FRONTEND_IMAGE_FETCH_TIMEOUT"
# /v1/audio/* (http_frontend.openai.audio): upload size, decoded length, speech input length
MAX_AUDIO_BYTES_ENV = "MLX_FRONTEND_MAX_AUDIO_BYTES"
MAX_AUDIO_SECONDS_ENV = "MLX_FRONTEND_MAX_AUDIO_SECONDS"
MAX_SPEECH_CHARS_ENV = "MLX_FRONTEND_MAX_SPEECH_CHARS"
MAX_AUDIO_JOBS_ENV = "MLX_FRONTEND_MAX_AUDIO_JOBS"
# The browser playground at / (http_frontend.playground); "0" turns it off for API-only deployments.
PLAYGROUND_ENV = "MLX_FRONTEND_PLAYGROUND"

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_MESSAGES = 2048
DEFAULT_MAX_PENDING_BYTES = 8 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_MAX_IMAGE_BYTES = 10 * 1024 * 1024
DEFAULT_IMAGE_FETCH_TIMEOUT = 10.0
DEFAULT_MAX_AUDIO_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit for /v1/audio/transcriptions
# 16 kHz float32 samples travel to the engine in one frame (protocol MAX_FRAME_BYTES, 32 MiB): 480 s is
# 30.7 MB, so the default leaves room for the rest of the CALL.
DEFAULT_MAX_AUDIO_SECONDS = 480.0
MAX_AUDIO_SECONDS_CEILING = 520.0
DEFAULT_MAX_SPEECH_CHARS = 4096  # OpenAI's limit on /v1/audio/speech `input`
# Uploads one worker decodes and holds at once: a 91 KB FLAC of 470 s silence is 30 MB of samples (and copies).
DEFAULT_MAX_AUDIO_JOBS = 4


def split_list(value: str | None) -> tuple[str, ...]:
    """A comma-separated variable as a tuple, blanks dropped (so "" means none)."""
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


def _positive_int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    """An integer >= 1; unset, empty, "0" or "none" give `default` (None = unlimited)."""
    raw = environ.get(name, "").strip()
    if raw.lower() in ("", "0", "none", "unlimited"):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def _bool(environ: Mapping[str, str], name: str) -> bool:
    """A switch variable: 1/true/yes/on is on, unset/empty/0/false/no/off is off, anything else an error."""
    raw = environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be true or false, got {raw!r}")


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


def _audio_seconds(environ: Mapping[str, str]) -> float:
    value = _seconds(environ, MAX_AUDIO_SECONDS_ENV, DEFAULT_MAX_AUDIO_SECONDS)
    if value > MAX_AUDIO_SECONDS_CEILING:
        raise ValueError(f"{MAX_AUDIO_SECONDS_ENV} may be at most {MAX_AUDIO_SECONDS_CEILING:g} (the decoded clip "
                         "travels to the engine in one 32 MiB frame)")
    return value


@dataclass(frozen=True)
class FrontendSettings:
    """Security, limits and timeouts of one front-end worker."""

    api_keys: tuple[str, ...] = ()
    # Keys that may also unload the model and change adapters (`needs_admin`); they work everywhere.
    admin_api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_tokens_limit: int | None = None  # None: no ceiling beyond the engine's own checks
    # Stop strings per request and characters per stop string (every token is matched against them).
    max_stop_strings: int = 16
    max_stop_length: int = 1024
    # Output one stream may hold unread (estimated bytes) before its client is cut off and its request aborted.
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    log_level: str = "info"
    # Media in chat messages: http(s) image URLs to private/loopback addresses are refused unless allowed.
    allow_private_image_urls: bool = False
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # per image or audio clip, inline or fetched
    image_fetch_timeout: float = DEFAULT_IMAGE_FETCH_TIMEOUT  # seconds for one URL, redirects included
    playground: bool = True  # serve the browser playground at / and /playground
    max_audio_bytes: int = DEFAULT_MAX_AUDIO_BYTES  # one uploaded audio file (transcriptions, translations)
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS  # decoded length of one upload
    max_speech_chars: int = DEFAULT_MAX_SPEECH_CHARS  # characters of /v1/audio/speech `input`
    max_audio_jobs: int = DEFAULT_MAX_AUDIO_JOBS  # uploads decoded and in flight at once, per worker; others wait

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FrontendSettings:
        env = os.environ if environ is None else environ
        timeout_raw = env.get(REQUEST_TIMEOUT_ENV, "").strip()
        try:
            request_timeout = float(timeout_raw) if timeout_raw else DEFAULT_REQUEST_TIMEOUT
        except ValueError:
            raise ValueError(f"{REQUEST_TIMEOUT_ENV} must be a number of seconds, got {timeout_raw!r}") from None
        return cls(
            api_keys=split_list(env.get(API_KEY_ENV)),
            admin_api_keys=split_list(env.get(ADMIN_API_KEY_ENV)),
            allowed_origins=split_list(env.get(ALLOWED_ORIGINS_ENV)),
            max_body_bytes=_positive_int(env, MAX_BODY_BYTES_ENV, DEFAULT_MAX_BODY_BYTES),
            max_messages=_positive_int(env, MAX_MESSAGES_ENV, DEFAULT_MAX_MESSAGES),
            max_tokens_limit=_positive_int(env, MAX_TOKENS_LIMIT_ENV, None),
            max_stop_strings=_positive_int(env, MAX_STOP_STRINGS_ENV, 16),
            max_stop_length=_positive_int(env, MAX_STOP_LENGTH_ENV, 1024),
            max_pending_bytes=_positive_int(env, MAX_PENDING_BYTES_ENV, DEFAULT_MAX_PENDING_BYTES),
            request_timeout=request_timeout,
            log_level=env.get(LOG_LEVEL_ENV, "info").strip() or "info",
            allow_private_image_urls=_bool(env, ALLOW_PRIVATE_IMAGE_URLS_ENV),
            max_image_bytes=_positive_int(env, MAX_IMAGE_BYTES_ENV, DEFAULT_MAX_IMAGE_BYTES),
            image_fetch_timeout=_seconds(env, IMAGE_FETCH_TIMEOUT_ENV, DEFAULT_IMAGE_FETCH_TIMEOUT),
            # On unless turned off: unset means on, so a plain gunicorn run serves it too.
            playground=_bool(env, PLAYGROUND_ENV) if env.get(PLAYGROUND_ENV, "").strip() else True,
            max_audio_bytes=_positive_int(env, MAX_AUDIO_BYTES_ENV, DEFAULT_MAX_AUDIO_BYTES),
            max_audio_seconds=_audio_seconds(env),
            max_speech_chars=_positive_int(env, MAX_SPEECH_CHARS_ENV, DEFAULT_MAX_SPEECH_CHARS),
            max_audio_jobs=_positive_int(env, MAX_AUDIO_JOBS_ENV, DEFAULT_MAX_AUDIO_JOBS),
        )

    def __repr__(self) -> str:
        # Never print the keys themselves (settings end up in logs and tracebacks).
        return (f"FrontendSettings(api_keys=<{len(self.api_keys)} configured>, "
                f"admin_api_keys=<{len(self.admin_api_keys)} configured>, "
                f"allowed_origins={self.allowed_origins}, max_body_bytes={self.max_body_bytes}, "
                f"max_messages={self.max_messages}, max_tokens_limit={self.max_tokens_limit}, "
                f"request_timeout={self.request_timeout}, log_level={self.log_level!r}, "
                f"allow_private_image_urls={self.allow_private_image_urls}, max_image_bytes={self.max_image_bytes}, "
                f"image_fetch_timeout={self.image_fetch_timeout}, playground={self.playground}, "
                f"max_audio_bytes={self.max_audio_bytes}, max_audio_seconds={self.max_audio_seconds}, "
                f"max_speech_chars={self.max_speech_chars}, max_audio_jobs={self.max_audio_jobs})")


# -- the `frontend` command's flags for these settings ---------------------------------------
def _limit_arg(text: str) -> int:
    """argparse type: a positive integer, or 0 / "none" for no limit (returned as 0)."""
    if text.strip().lower() in ("", "0", "none", "unlimited"):
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _key_arg(text: str) -> str:
    key = text.strip()
    if not key or "," in key:
        raise argparse.ArgumentTypeError("an API key must be non-empty and contain no comma")
    return key


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Security and limit flags; each defaults to its environment variable."""
    env = os.environ.get
    parser.add_argument("--api-key", action="append", type=_key_arg, default=None, metavar="KEY",
                        help="require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on every route "
                             "but GET /health and the playground's page; repeat for several keys. Prefer the "
                             "variable: flags show in `ps`. "
                             f"[{API_KEY_ENV}, comma-separated] (default: none, no authentication)")
    parser.add_argument("--admin-api-key", action="append", type=_key_arg, default=None, metavar="KEY",
                        help="a key that may also POST /unload and register or remove adapters (ordinary keys "
                             "get 403 there); it works on every route. Repeat for several. With keys but no admin "
                             f"key, nobody may use those routes. [{ADMIN_API_KEY_ENV}, comma-separated] "
                             "(default: none)")
    parser.add_argument("--allowed-origins", default=env(ALLOWED_ORIGINS_ENV, ""), metavar="ORIGINS",
                        help="comma-separated browser origins allowed by CORS, e.g. https://app.example.com "
                             f"('*' = any, never with credentials). [{ALLOWED_ORIGINS_ENV}] (default: none, "
                             "no CORS headers)")
    parser.add_argument("--max-body-bytes", type=_limit_arg,
                        default=env(MAX_BODY_BYTES_ENV, str(DEFAULT_MAX_BODY_BYTES)),
                        help="largest request body in bytes; larger gets 413 (0 = the default). "
                             f"[{MAX_BODY_BYTES_ENV}] (default: %(default)s)")
    parser.add_argument("--max-messages", type=_limit_arg, default=env(MAX_MESSAGES_ENV, str(DEFAULT_MAX_MESSAGES)),
                        help="most chat messages in one request; more gets 400 (0 = the default). "
                             f"[{MAX_MESSAGES_ENV}] (default: %(default)s)")
    parser.add_argument("--max-tokens-limit", type=_limit_arg, default=env(MAX_TOKENS_LIMIT_ENV, "0"),
                        help="ceiling on a request's max_tokens / max_completion_tokens; over it gets 400 "
                             f"max_tokens_exceeded. 0 = no ceiling. [{MAX_TOKENS_LIMIT_ENV}] (default: %(default)s)")
    parser.add_argument("--max-stop-strings", type=_limit_arg, default=env(MAX_STOP_STRINGS_ENV, "16"),
                        help="most stop strings in one request; more gets 400 (0 = the default). Keep it at or "
                             f"under the engine's --max-stop-strings. [{MAX_STOP_STRINGS_ENV}] (default: %(default)s)")
    parser.add_argument("--max-stop-length", type=_limit_arg, default=env(MAX_STOP_LENGTH_ENV, "1024"),
                        help="most characters in one stop string; longer gets 400 (0 = the default). "
                             f"[{MAX_STOP_LENGTH_ENV}] (default: %(default)s)")
    parser.add_argument("--max-pending-bytes", type=_limit_arg,
                        default=env(MAX_PENDING_BYTES_ENV, str(DEFAULT_MAX_PENDING_BYTES)),
                        help="most output (estimated bytes) one stream may leave unread; a client that stops "
                             "reading is then cut off with a slow_client error and its request aborted (0 = the "
                             f"default). [{MAX_PENDING_BYTES_ENV}] (default: %(default)s)")
    add_media_flags(parser)
    add_audio_flags(parser)
    parser.add_argument("--no-playground", dest="playground", action="store_false",
                        default=env(PLAYGROUND_ENV, "1").strip().lower() not in ("0", "false", "no", "off"),
                        help="do not serve the browser playground at / and /playground (API-only deployments; "
                             f"those paths then answer 404). [{PLAYGROUND_ENV}=0] (default: served)")


def _positive_seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_media_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for images/audio in chat messages (`MediaCollector`); each defaults to its variable."""
    env = os.environ.get
    parser.add_argument("--allow-private-image-urls", action="store_true",
                        default=env(ALLOW_PRIVATE_IMAGE_URLS_ENV, "").strip().lower() in ("1", "true", "yes", "on"),
                        help="let image_url parts fetch from loopback, private, link-local and other non-public "
                             "addresses (refused by default: a client could make the server read internal "
                             f"services). [{ALLOW_PRIVATE_IMAGE_URLS_ENV}=true] (default: off)")
    parser.add_argument("--max-image-bytes", type=_limit_arg,
                        default=env(MAX_IMAGE_BYTES_ENV, str(DEFAULT_MAX_IMAGE_BYTES)),
                        help="largest image or audio clip in bytes, inline (data: URL / base64) or fetched; "
                             f"larger gets 400 (0 = the default). [{MAX_IMAGE_BYTES_ENV}] (default: %(default)s)")
    parser.add_argument("--image-fetch-timeout", type=_positive_seconds_arg,
                        default=env(IMAGE_FETCH_TIMEOUT_ENV) or str(DEFAULT_IMAGE_FETCH_TIMEOUT),
                        help="seconds to fetch one http(s) image URL, redirects included; slower gets 400. "
                             f"[{IMAGE_FETCH_TIMEOUT_ENV}] (default: %(default)s)")


def _audio_seconds_arg(text: str) -> float:
    value = _positive_seconds_arg(text)
    if value > MAX_AUDIO_SECONDS_CEILING:
        raise argparse.ArgumentTypeError(f"at most {MAX_AUDIO_SECONDS_CEILING:g} seconds (the decoded clip travels "
                                         "to the engine in one 32 MiB frame)")
    return value


def add_audio_flags(parser: argparse.ArgumentParser) -> None:
    """Limits of /v1/audio/transcriptions, /translations and /speech; each defaults to its variable."""
    env = os.environ.get
    parser.add_argument("--max-audio-bytes", type=_limit_arg,
                        default=env(MAX_AUDIO_BYTES_ENV, str(DEFAULT_MAX_AUDIO_BYTES)),
                        help="largest audio file uploaded to /v1/audio/transcriptions or /translations, in bytes; "
                             f"larger gets 413 (0 = the default, OpenAI's 25 MB). [{MAX_AUDIO_BYTES_ENV}] "
                             "(default: %(default)s)")
    parser.add_argument("--max-audio-seconds", type=_audio_seconds_arg,
                        default=env(MAX_AUDIO_SECONDS_ENV) or str(DEFAULT_MAX_AUDIO_SECONDS),
                        help="longest decoded upload in seconds; longer gets 400 audio_too_long (decoding stops "
                             f"there). At most {MAX_AUDIO_SECONDS_CEILING:g}: the 16 kHz samples go to the engine in "
                             f"one frame. [{MAX_AUDIO_SECONDS_ENV}] (default: %(default)s)")
    parser.add_argument("--max-speech-chars", type=_limit_arg,
                        default=env(MAX_SPEECH_CHARS_ENV, str(DEFAULT_MAX_SPEECH_CHARS)),
                        help="most characters of /v1/audio/speech `input`; more gets 400 (0 = the default, "
                             f"OpenAI's 4096). [{MAX_SPEECH_CHARS_ENV}] (default: %(default)s)")
    parser.add_argument("--max-audio-jobs", type=_limit_arg,
                        default=env(MAX_AUDIO_JOBS_ENV, str(DEFAULT_MAX_AUDIO_JOBS)),
                        help="uploads one worker decodes and keeps in flight at once (a few KB of compressed "
                             "silence decodes to tens of MB); more wait their turn (0 = the default). "
                             f"[{MAX_AUDIO_JOBS_ENV}] (default: %(default)s)")


def flags_to_env(args: argparse.Namespace) -> dict[str, str]:
    """The parsed flags as the variables workers read (the flag wins over the variable)."""
    keys = args.api_key if args.api_key is not None else split_list(os.environ.get(API_KEY_ENV))
    host = getattr(args, "host", "127.0.0.1")
    admin_keys = (args.admin_api_key if getattr(args, "admin_api_key", None) is not None
                  else split_list(os.environ.get(ADMIN_API_KEY_ENV)))
    if not keys and not admin_keys and not _is_loopback(host):
        logging.getLogger("http_frontend.cli").warning(
            "listening on %s without an API key: anyone who can reach it can use the model "
            "(set --api-key or %s)", host, API_KEY_ENV)
    return {
        API_KEY_ENV: ",".join(keys),
        ADMIN_API_KEY_ENV: ",".join(admin_keys),
        ALLOWED_ORIGINS_ENV: ",".join(split_list(args.allowed_origins)),
        MAX_BODY_BYTES_ENV: str(args.max_body_bytes or DEFAULT_MAX_BODY_BYTES),
        MAX_MESSAGES_ENV: str(args.max_messages or DEFAULT_MAX_MESSAGES),
        MAX_TOKENS_LIMIT_ENV: str(args.max_tokens_limit or ""),
        MAX_STOP_STRINGS_ENV: str(getattr(args, "max_stop_strings", 0) or 16),
        MAX_STOP_LENGTH_ENV: str(getattr(args, "max_stop_length", 0) or 1024),
        MAX_PENDING_BYTES_ENV: str(getattr(args, "max_pending_bytes", 0) or DEFAULT_MAX_PENDING_BYTES),
        ALLOW_PRIVATE_IMAGE_URLS_ENV: "true" if getattr(args, "allow_private_image_urls", False) else "",
        MAX_IMAGE_BYTES_ENV: str(getattr(args, "max_image_bytes", 0) or DEFAULT_MAX_IMAGE_BYTES),
        IMAGE_FETCH_TIMEOUT_ENV: str(getattr(args, "image_fetch_timeout", DEFAULT_IMAGE_FETCH_TIMEOUT)),
        PLAYGROUND_ENV: "1" if getattr(args, "playground", True) else "0",
        MAX_AUDIO_BYTES_ENV: str(getattr(args, "max_audio_bytes", 0) or DEFAULT_MAX_AUDIO_BYTES),
        MAX_AUDIO_SECONDS_ENV: str(getattr(args, "max_audio_seconds", DEFAULT_MAX_AUDIO_SECONDS)),
        MAX_SPEECH_CHARS_ENV: str(getattr(args, "max_speech_chars", 0) or DEFAULT_MAX_SPEECH_CHARS),
        MAX_AUDIO_JOBS_ENV: str(getattr(args, "max_audio_jobs", 0) or DEFAULT_MAX_AUDIO_JOBS),
    }


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def configure_logging(level: str) -> None:
    """Sends the app's own loggers (access lines with rids included) to stderr.

    gunicorn configures only its `gunicorn.*` loggers; without this the front-end's
    INFO records would be dropped by Python's last-resort handler. A logging setup
    made by the embedding process (a root handler already present) is left alone.
    """
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"))
    app_logger = logging.getLogger("http_frontend")
    if not app_logger.handlers:
        app_logger.addHandler(handler)
    numeric = logging.getLevelName(level.upper())
    app_logger.setLevel(numeric if isinstance(numeric, int) else logging.INFO)
