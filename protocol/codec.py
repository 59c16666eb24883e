"""Encode and decode frames: `[type: 1 byte][msgpack body]`, validated at the boundary."""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.messages import (
    MAX_FRAME_BYTES,
    PARAM_TYPES,
    SCHEMAS,
    MsgType,
    check_fields,
)


class ProtocolError(ValueError):
    """A frame that cannot be accepted. `rid`/`cid` are set when the sender can be answered."""

    def __init__(self, message: str, rid: str | None = None, cid: str | None = None):
        super().__init__(message)
        self.rid = rid
        self.cid = cid


def encode(msg_type: MsgType, body: dict[str, Any]) -> bytes:
    """One frame for `msg_type`. Bodies are plain maps of msgpack-able values."""
    return bytes((int(msg_type),)) + msgpack.packb(body, use_bin_type=True)


def _check_add(body: dict[str, Any]) -> str | None:
    """ADD carries nested fields the engine relies on: check them here, not on the model thread."""
    if body.get("messages") is None and body.get("prompt") is None:
        return "ADD needs 'messages' or 'prompt'"
    messages = body.get("messages")
    if messages is not None and not all(isinstance(m, dict) for m in messages):
        return "every message must be a map"
    # A token prompt's ids are checked by the engine's admission pool, after its length: a walk over millions
    # of ids here held the io thread (and every stream's frames) for a second.
    params = body["params"]
    for name, types in PARAM_TYPES.items():
        if name in params:
            value = params[name]
            if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
                return f"param '{name}' has wrong type {type(value).__name__}"
    stop = params.get("stop")
    if stop is not None and not all(isinstance(s, str) for s in stop):
        return "param 'stop' must be a list of strings"
    return None


def decode(frame: bytes) -> tuple[MsgType, dict[str, Any]]:
    """Type and body of a frame; raises ProtocolError for anything malformed."""
    if not frame:
        raise ProtocolError("empty frame")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg_type = MsgType(frame[0])
    except ValueError:
        raise ProtocolError(f"unknown message type {frame[0]}") from None
    try:
        body = msgpack.unpackb(
            frame[1:], raw=False, strict_map_key=True
        )
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"undecodable {msg_type.name} body: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{msg_type.name} body must be a map")
    rid = body.get("rid") if isinstance(body.get("rid"), str) else None
    cid = body.get("cid") if isinstance(body.get("cid"), str) else None
    problem = check_fields(body, SCHEMAS[msg_type])
    if problem is None and msg_type == MsgType.ADD:
        problem = _check_add(body)
    if problem is None and msg_type == MsgType.ABORT:
        if not all(isinstance(r, str) for r in body["rids"]):
            problem = "ABORT 'rids' must be strings"
    if problem is None and msg_type == MsgType.DELTAS:
        if not all(isinstance(i, dict) and isinstance(i.get("rid"), str) for i in body["items"]):
            problem = "every DELTAS item must be a map with a 'rid'"
    if problem is not None:
        raise ProtocolError(f"invalid {msg_type.name}: {problem}", rid=rid, cid=cid)
    return msg_type, body
