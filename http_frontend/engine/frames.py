"""What the wire can carry: ADD and CALL bodies packed (and refused) before anything is registered,
and the estimated memory a stream's unread output holds.

msgpack cannot carry an integer outside 64 bits or a string with a lone UTF-16 surrogate, and
the engine drops any frame over `MAX_FRAME_BYTES` before it can tell who sent it. So the
front-end packs a request itself first: such a request is answered at once with a 4xx, never
left waiting for an answer that cannot come. `delta_bytes` is what `RequestStream` counts
against `max_pending_bytes`.
"""

from __future__ import annotations

from typing import Any

from http_frontend.errors import APIError, bad_request
from protocol import MsgType, encode
from protocol.messages import MAX_FRAME_BYTES


class UnsendableRequest(Exception):
    """A request that cannot become a frame: over `MAX_FRAME_BYTES` once packed, or a value msgpack cannot carry.

    `too_large` tells the two apart; `param` names the request field at fault when one could be found.
    """

    def __init__(self, message: str, *, too_large: bool = False, param: str | None = None):
        super().__init__(message)
        self.too_large = too_large
        self.param = param

    def api_error(self) -> APIError:
        """As the client sees it: 413 `request_too_large` when too large once packed, else 400 `invalid_value`."""
        if self.too_large:
            return APIError(413, str(self), code="request_too_large")
        return bad_request(str(self), param=self.param, code="invalid_value")


# msgpack's refusals: an int outside 64 bits (OverflowError), a lone surrogate (UnicodeEncodeError), a type it
# has no encoding for (TypeError), nesting past its limit (ValueError).
UNPACKABLE = (OverflowError, UnicodeEncodeError, TypeError, ValueError)


def packed_frame(msg_type: MsgType, body: dict[str, Any]) -> bytes:
    """`body` as one frame, or UnsendableRequest saying why the engine could never receive it."""
    try:
        frame = encode(msg_type, body)
    except UNPACKABLE as exc:
        param = next((key for key, value in body.items() if not _packs(msg_type, {key: value})), None)
        raise UnsendableRequest(f"The request holds a value that cannot be sent to the engine ({_why(exc)})",
                                param=param) from None
    if len(frame) > MAX_FRAME_BYTES:
        raise UnsendableRequest(f"The request is {len(frame)} bytes once packed for the engine, over the "
                                f"{MAX_FRAME_BYTES}-byte limit of one frame", too_large=True)
    return frame


def _packs(msg_type: MsgType, body: dict[str, Any]) -> bool:
    try:
        encode(msg_type, body)
    except UNPACKABLE:
        return False
    return True


def _why(exc: Exception) -> str:
    if isinstance(exc, OverflowError):
        return "an integer outside the 64-bit range"
    if isinstance(exc, UnicodeEncodeError):
        return "a string with a lone UTF-16 surrogate, which is not valid Unicode"
    if isinstance(exc, ValueError):
        return "values nested too deeply"
    return str(exc)


# Rough bytes one logprobs alternative costs in this process (a dict with a string, a float and a byte list),
# plus per character of its token.
LOGPROB_ENTRY_BYTES = 320
LOGPROB_CHAR_BYTES = 10


def delta_bytes(item: dict[str, Any]) -> int:
    """An estimate of the memory one DELTAS item adds to a pending update (what `max_pending_bytes` counts)."""
    size = len(item.get("text") or "") + len(item.get("reasoning") or "") + 8 * len(item.get("token_ids") or ())
    for call in item.get("tool_calls") or ():
        size += 256 + sum(len(value) for value in call.values() if isinstance(value, str))
    for piece in item.get("tool_call_deltas") or ():  # merged into the call's last piece while unread
        size += sum(len(value) for value in piece.values() if isinstance(value, str))
    for entry in (*(item.get("logprobs") or ()), *(item.get("prompt_logprobs") or ())):
        for alternative in (entry, *(entry.get("top_logprobs") or ())):
            size += LOGPROB_ENTRY_BYTES + LOGPROB_CHAR_BYTES * len(alternative.get("token") or "")
    return size
