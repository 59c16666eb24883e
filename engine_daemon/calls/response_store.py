"""The Responses API store: what `previous_response_id`, GET and DELETE need, kept in the engine.

Front-ends are stateless and may be many (workers, hosts), so a response created
through one must be resumable through any other: the store lives here, next to
the model, and is reached with CALLs answered on the io thread (no mlx needed).

Each record is a msgpack-able map (as it arrived in the CALL): the conversation
as chat messages (this response's output included) and the response object.
Records expire after a TTL and the whole store is held under a byte cap, the
oldest records evicted first. An engine restart loses the store.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from engine_daemon.errors import RequestError

log = logging.getLogger(__name__)

DEFAULT_TTL_SECONDS = 3600.0
DEFAULT_MAX_BYTES = 64 * 2**20
MAX_ID_LENGTH = 256


@dataclass
class _Entry:
    # Kept packed: the byte cap then counts what the store really holds. Decoded, a record of a
    # million empty maps took ~70x its packed size (the cap was counted packed).
    packed: bytes
    size: int
    expires_at: float


class ResponseStore:
    """Records by response id, oldest first; expired ones are dropped lazily and on every put."""

    def __init__(self, ttl: float = DEFAULT_TTL_SECONDS, max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Stores (or replaces) a record; False when it alone exceeds the byte cap (then not stored)."""
        self._drop(response_id)
        packed = msgpack.packb(record, use_bin_type=True)
        size = len(packed) + len(response_id)
        if size > self.max_bytes:
            log.warning("response %s not stored: %d bytes exceed the store's cap of %d", response_id, size,
                        self.max_bytes)
            return False
        self._expire()
        while self._entries and self.bytes + size > self.max_bytes:
            oldest, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
            self.evicted += 1
            log.info("response store full: evicted %s", oldest)
        self._entries[response_id] = _Entry(packed, size, self._clock() + self.ttl)
        self.bytes += size
        return True

    def get(self, response_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry.expires_at <= self._clock():
            self._drop(response_id)
            return None
        return msgpack.unpackb(entry.packed, raw=False)

    def delete(self, response_id: str) -> bool:
        """True when a live record was there."""
        found = self.get(response_id) is not None
        self._drop(response_id)
        return found

    def stats(self) -> dict[str, Any]:
        self._expire()
        return {"responses_stored": len(self._entries), "responses_bytes": self.bytes,
                "responses_evicted": self.evicted}

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size

    def _expire(self) -> None:
        # One TTL for all and insertion order kept: the expired records are at the front.
        now = self._clock()
        while self._entries:
            response_id, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                break
            self._drop(response_id)


def _response_id(args: dict[str, Any]) -> str:
    response_id = args.get("id")
    if not isinstance(response_id, str) or not 0 < len(response_id) <= MAX_ID_LENGTH:
        raise RequestError(400, "invalid_value", f"'id' must be a string of 1 to {MAX_ID_LENGTH} characters")
    return response_id


def put(store: ResponseStore, args: dict[str, Any]) -> dict[str, bool]:
    """responses.put {id, record} -> {"stored": bool}."""
    response_id = _response_id(args)
    record = args.get("record")
    if not isinstance(record, dict):
        raise RequestError(400, "invalid_value", "'record' must be a map")
    return {"stored": store.put(response_id, record)}


def get(store: ResponseStore, args: dict[str, Any]) -> dict[str, Any] | None:
    """responses.get {id} -> the record, or None."""
    return store.get(_response_id(args))


def delete(store: ResponseStore, args: dict[str, Any]) -> dict[str, bool]:
    """responses.delete {id} -> {"deleted": bool}."""
    return {"deleted": store.delete(_response_id(args))}
