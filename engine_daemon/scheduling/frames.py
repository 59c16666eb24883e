"""A step's events as wire frames: one DELTAS frame per peer, and never an exception for the thread.

A value a model generated (or a bug) that msgpack cannot carry (an integer past 64 bits, a
lone surrogate in strict mode...) must end the request it belongs to, not the mlx thread:
the peer's items are encoded together first (the common case, one frame), and only when that
fails one by one, so the unencodable item is found, replaced by an ERROR for its request and
reported back so the scheduler frees it.
"""

from __future__ import annotations

import logging
from typing import Any

from engine_daemon.scheduling.base import Event
from protocol import MsgType, encode

log = logging.getLogger(__name__)

UNENCODABLE = {"status": 500, "code": "unencodable_output", "type": "server_error",
               "message": "The engine produced output it could not send; the request was ended"}


def encode_events(events: list[Event]) -> tuple[list[tuple[bytes, bytes]], set[str]]:
    """(peer, frame) pairs to send, and the ids of requests whose output could not be encoded."""
    frames: list[tuple[bytes, bytes]] = []
    failed: set[str] = set()
    deltas: dict[bytes, list[dict[str, Any]]] = {}
    for peer, msg_type, body in events:
        if msg_type == MsgType.DELTAS:
            deltas.setdefault(peer, []).append(body)
            continue
        try:
            frames.append((peer, encode(msg_type, body)))
        except Exception:
            log.exception("could not encode a %s frame", msg_type.name)
            frames.append((peer, encode(MsgType.ERROR, {**UNENCODABLE, **_names_of(body)})))
            if body.get("rid"):
                failed.add(str(body["rid"]))
    for peer, items in deltas.items():
        try:
            frames.append((peer, encode(MsgType.DELTAS, {"items": items})))
            continue
        except Exception:
            log.exception("could not encode a DELTAS frame: finding the request it came from")
        good = []
        for item in items:
            try:
                encode(MsgType.DELTAS, {"items": [item]})
                good.append(item)
            except Exception:
                rid = str(item.get("rid"))
                failed.add(rid)
                frames.append((peer, encode(MsgType.ERROR, {**UNENCODABLE, "rid": rid})))
        if good:
            frames.append((peer, encode(MsgType.DELTAS, {"items": good})))
    return frames, failed


def _names_of(body: dict[str, Any]) -> dict[str, str]:
    """The request or call id an unencodable reply answered, so its waiter is woken."""
    return {key: str(body[key]) for key in ("rid", "cid") if isinstance(body.get(key), str)}
