"""Encode and decode frames: `[type: 1 byte][msgpack body]`, validated at the boundary."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

from protocol.messages import (
    FRONTEND_TO_ENGINE,
    ID_FIELDS,
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    PARAM_TYPES,
    SCHEMAS,
    MsgType,
    check_fields,
)
from protocol.token_ids import ID_BYTES


class ProtocolError(ValueError):
    """A frame that cannot be accepted. `rid`/`cid` are set when the sender can be answered."""

    def __init__(self, message: str, rid: str | None = None, cid: str | None = None, param: str | None = None):
        super().__init__(message)
        self.rid = rid
        self.cid = cid
        self.param = param  # the field at fault, when one is (an ADD's param or nested field)


def _as_builtin(value: Any) -> Any:
    """What msgpack packs of a subclass of a builtin scalar (NumPy's float64, a str subclass) and msgspec refuses."""
    for kind in (bool, int, float, str, bytes):
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")


def pack(value: Any) -> bytes:
    """`value` as msgpack, as `msgpack.packb(value, use_bin_type=True)` writes it (see `encode`)."""
    return msgspec.msgpack.encode(value, enc_hook=_as_builtin)


def encode(msg_type: MsgType, body: dict[str, Any]) -> bytes:
    """One frame for `msg_type`. Bodies are plain maps of msgpack-able values.

    Packed by msgspec: the same bytes as `msgpack.packb(body, use_bin_type=True)` (a property test
    compares them; subclasses of builtin scalars such as NumPy's float64 go through `_as_builtin`), the same
    refusals of integers outside 64 bits and lone surrogates, ~4x faster. The C packer
    holds the GIL throughout: a 13 MB token-id prompt held it 0.14 s in msgpack, beside every stream of its worker.
    """
    return bytes((int(msg_type),)) + pack(body)


def _named_function(item: Any, where: str) -> str | None:
    """A tool or a tool call: a map whose `function`, when present, is a map with a string `name`."""
    if not isinstance(item, dict):
        return f"{where} must be a map"
    function = item.get("function")
    if function is None:
        return None if "function" not in item else f"{where}.function must be a map"
    if not isinstance(function, dict):
        return f"{where}.function must be a map"
    if not isinstance(function.get("name", ""), str):
        return f"{where}.function.name must be a string"
    return None


def _check_message(message: Any, where: str) -> str | None:
    """The fields of a chat message the engine reads itself (the chat template judges the rest)."""
    if not isinstance(message, dict):
        return "every message must be a map"
    if not isinstance(message.get("role", ""), str):
        return f"{where}.role must be a string"
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        return f"{where}.content must be a string or a list of parts"
    if isinstance(content, list) and not all(isinstance(part, (str, dict)) for part in content):
        return f"{where}.content parts must be maps"
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            return f"{where}.tool_calls must be a list"
        for index, call in enumerate(calls):
            if problem := _named_function(call, f"{where}.tool_calls[{index}]"):
                return problem
    return None


def _check_add(body: dict[str, Any]) -> tuple[str, str] | None:
    """ADD carries nested fields the engine relies on: check them here, not on the model thread.

    Returns (what is wrong, the field it is in) for the first problem found.
    """
    if body.get("messages") is None and body.get("prompt") is None:
        return "ADD needs 'messages' or 'prompt'", "messages"
    for index, message in enumerate(body.get("messages") or ()):
        if problem := _check_message(message, f"messages[{index}]"):
            return problem, "messages"
    for index, tool in enumerate(body.get("tools") or ()):
        if problem := _named_function(tool, f"tools[{index}]"):
            return problem, "tools"
    # A token prompt's ids are checked by the engine's admission pool, after its length: a walk over millions
    # of ids here held the io thread (and every stream's frames) for a second.
    prompt = body.get("prompt")
    if isinstance(prompt, bytes) and len(prompt) % ID_BYTES:
        return f"a packed prompt must hold whole {ID_BYTES}-byte token ids, got {len(prompt)} bytes", "prompt"
    params = body["params"]
    for name, types in PARAM_TYPES.items():
        if name in params:
            value = params[name]
            if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
                return f"param '{name}' has wrong type {type(value).__name__}", name
    stop = params.get("stop")
    if stop is not None and not all(isinstance(s, str) for s in stop):
        return "param 'stop' must be a list of strings", "stop"
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
    problem, param = check_fields(body, SCHEMAS[msg_type]), None
    if problem is None and msg_type in FRONTEND_TO_ENGINE:
        for name in ID_FIELDS & body.keys():
            if isinstance(body[name], str) and len(body[name]) > MAX_ID_CHARS:
                problem, param = f"'{name}' is longer than {MAX_ID_CHARS} characters", name
    if problem is None and msg_type == MsgType.ADD:
        problem, param = _check_add(body) or (None, None)
    if problem is None and msg_type == MsgType.ABORT:
        if not all(isinstance(r, str) for r in body["rids"]):
            problem = "ABORT 'rids' must be strings"
    if problem is None and msg_type == MsgType.DELTAS:
        if not all(isinstance(i, dict) and isinstance(i.get("rid"), str) for i in body["items"]):
            problem = "every DELTAS item must be a map with a 'rid'"
    if problem is not None:
        raise ProtocolError(f"invalid {msg_type.name}: {problem}", rid=rid, cid=cid, param=param)
    return msg_type, body
