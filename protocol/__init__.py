"""The versioned msgpack wire contract between `engined` and its front-ends.

Pure Python: no mlx, no zmq. Both sides import only this package from each other.
A frame is ``[type: 1 byte][msgpack body]``; the ROUTER adds the identity frame.
"""

from protocol.codec import ProtocolError, decode, encode
from protocol.messages import (
    PROMPT_LOGPROBS,
    PROTOCOL_VERSION,
    CallMethod,
    MsgType,
    new_request_id,
    request_id_owner,
)

__all__ = [
    "PROMPT_LOGPROBS",
    "PROTOCOL_VERSION",
    "CallMethod",
    "MsgType",
    "ProtocolError",
    "decode",
    "encode",
    "new_request_id",
    "request_id_owner",
]
