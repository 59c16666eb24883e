"""Which engines a front-end routes to: `--endpoint` (repeatable) and its variables, parsed once.

An endpoint may be named, `NAME=tcp://host:port`; the name is the engine's id in
`X-Engine-Id`, in response ids, on /health and in metric labels, and it is what the
router hashes, so every front-end on every host must give one engine the same name.
An unnamed endpoint is named after a digest of its address, the same everywhere the
address is written the same way. CURVE server keys come one for all engines, or one
per endpoint in the same order.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from http_frontend.engine.routing import DEFAULT_EPSILON, DEFAULT_MIN_BOUND
from protocol.endpoints import ENDPOINT_ENV, default_endpoint

ENDPOINTS_ENV = "MLX_ENGINE_ENDPOINTS"
EPSILON_ENV = "MLX_FRONTEND_ROUTING_EPSILON"
SERVER_KEYS_ENV = "MLX_FRONTEND_CURVE_SERVER_KEYS"  # per-endpoint keys, os.pathsep-separated
MIN_BOUND_ENV = "MLX_FRONTEND_ROUTING_MIN_BOUND"

ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,31}")  # no '_': response ids put the id before one


@dataclass(frozen=True)
class EngineSpec:
    engine_id: str
    endpoint: str
    curve_server_key: str | None = None  # None: the shared key (MLX_FRONTEND_CURVE_SERVER_KEY), if any


def split_endpoints(value: str) -> list[str]:
    """`MLX_ENGINE_ENDPOINTS`: separated by commas, or by os.pathsep where the next endpoint begins.

    On Unix os.pathsep is ':', which addresses hold too (`ipc://`, `tcp://host:port`): a ':' only
    separates when an endpoint (`[NAME=]ipc://` or `tcp://`) starts right after it.
    """
    sep = re.escape(os.pathsep)
    parts = re.split(rf",|{sep}(?=(?:[A-Za-z0-9-]+=)?(?:ipc|tcp)://)", value)
    return [part.strip() for part in parts if part.strip()]


def default_engine_id(endpoint: str) -> str:
    return "e" + hashlib.blake2b(endpoint.encode(), digest_size=4).hexdigest()


def parse_specs(endpoints: Sequence[str], server_keys: Sequence[str] = ()) -> list[EngineSpec]:
    """Named specs for `[NAME=]ENDPOINT` strings; ValueError for a bad name, a duplicate, a key count mismatch."""
    if server_keys and len(server_keys) not in (1, len(endpoints)):
        raise ValueError(f"give one CURVE server key for all engines or one per endpoint ({len(endpoints)}), "
                         f"not {len(server_keys)}")
    specs: list[EngineSpec] = []
    for index, text in enumerate(endpoints):
        name, sep, address = text.partition("=")
        if not sep or "://" in name:
            name, address = default_engine_id(text), text
        if not ENGINE_ID.fullmatch(name):
            raise ValueError(f"engine name {name!r} must be 1-32 letters, digits or '-' (in {text!r})")
        if not re.match(r"(ipc|tcp)://", address):
            raise ValueError(f"engine endpoint {address!r} must be ipc:// or tcp://")
        key = server_keys[index] if len(server_keys) > 1 else None
        specs.append(EngineSpec(name, address, key))
    if len({s.engine_id for s in specs}) != len(specs):
        raise ValueError(f"two engines share a name: {', '.join(s.engine_id for s in specs)}")
    if len({s.endpoint for s in specs}) != len(specs):
        raise ValueError("the same engine endpoint is given twice")
    return specs


def specs_from_env(environ: Mapping[str, str] | None = None) -> list[EngineSpec]:
    """$MLX_ENGINE_ENDPOINTS, else the single $MLX_ENGINE_ENDPOINT, else the per-user socket."""
    env = os.environ if environ is None else environ
    endpoints = split_endpoints(env.get(ENDPOINTS_ENV, "")) or [env.get(ENDPOINT_ENV) or default_endpoint()]
    keys = [k for k in env.get(SERVER_KEYS_ENV, "").split(os.pathsep) if k]
    return parse_specs(endpoints, keys)


def epsilon_from_env(environ: Mapping[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(EPSILON_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_EPSILON
    except ValueError:
        raise ValueError(f"{EPSILON_ENV} must be a number, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{EPSILON_ENV} must be positive, got {raw!r}")
    return value


def min_bound_from_env(environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    raw = env.get(MIN_BOUND_ENV, "").strip()
    try:
        value = int(raw) if raw else DEFAULT_MIN_BOUND
    except ValueError:
        raise ValueError(f"{MIN_BOUND_ENV} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{MIN_BOUND_ENV} must be at least 1, got {raw!r}")
    return value
