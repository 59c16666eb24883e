"""A prompt of token ids packed as one msgpack binary: little-endian unsigned 32-bit integers.

Why: the engine decodes every frame on its io thread, and a msgpack array of ids is one
Python int per id: a 13 MB body of 6.5 M ids held that thread (and the GIL the mlx thread
steps with) for ~0.12 s, so every stream of every front-end waited that long for a prompt
its window refuses anyway. A binary is one copy (~0.02 s for the same ids), and the engine's
admission pool refuses it by its length before turning any of it into ints.

An engine that reads packed prompts says so in its WELCOME (`FEATURE` in `features`); a
front-end packs only for such an engine, so either side can be upgraded first.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

FEATURE = "packed_token_ids"
ID_BYTES = 4
_TYPECODE = next(code for code in ("I", "L") if array(code).itemsize == ID_BYTES)


def pack_token_ids(ids: Sequence[int]) -> bytes | None:
    """`ids` as little-endian uint32, or None when one is not an int in [0, 2**32) (the engine names that)."""
    try:
        packed = array(_TYPECODE, ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def packed_count(data: bytes) -> int:
    """How many ids `data` holds, without reading them."""
    return len(data) // ID_BYTES


def unpack_token_ids(data: bytes) -> list[int]:
    """The ids `pack_token_ids` packed; ValueError when `data` is not whole 32-bit ids."""
    if len(data) % ID_BYTES:
        raise ValueError(f"a packed prompt of {len(data)} bytes is not whole {ID_BYTES}-byte token ids")
    ids = array(_TYPECODE)
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()
