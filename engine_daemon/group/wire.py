"""The plan broadcast: rank 0's bytes to every rank, as an `all_sum` on the generation stream.

Why the generation stream: the prototype that ran the control collectives on another
stream than mlx-lm's generation got corrupted payloads on rank 1 (UnpicklingError): two
streams do not order their collectives against each other. Every collective of a rank
here runs on the one stream its generator uses, so plans and forward passes interleave
in the same order on every rank.

One round trip per tick in the common case: a fixed `HEADER` bytes carry the length and
the first bytes of the plan; only a longer plan (new prompts) takes a second all_sum.
"""

from __future__ import annotations

import struct
from typing import Any

import mlx.core as mx
import numpy as np

HEADER = 128  # bytes of the first all_sum: 4 of length, the rest plan (a decode tick's plan is ~15 bytes)


class PlanChannel:
    """Rank 0 sends, the others receive; every rank calls `exchange` the same number of times."""

    def __init__(self, group: Any, stream: Any):
        self.group = group
        self.stream = stream
        self.rank = group.rank()
        self.exchanges = 0
        self.bytes_sent = 0

    def _all_sum(self, buffer: np.ndarray) -> np.ndarray:
        total = mx.distributed.all_sum(mx.array(buffer), group=self.group, stream=self.stream)
        mx.eval(total)
        return np.asarray(total)

    def exchange(self, payload: bytes | None = None) -> bytes:
        """Rank 0 passes its plan bytes and gets them back; followers pass nothing and get them."""
        head = np.zeros(HEADER, dtype=np.uint8)
        if self.rank == 0:
            assert payload is not None
            data = struct.pack("<I", len(payload)) + payload[:HEADER - 4]
            head[:len(data)] = np.frombuffer(data, dtype=np.uint8)
            self.bytes_sent += len(payload)
        head = self._all_sum(head)
        (length,) = struct.unpack("<I", head[:4].tobytes())
        first = head[4:4 + min(length, HEADER - 4)].tobytes()
        self.exchanges += 1
        if length <= HEADER - 4:
            return first
        rest = np.zeros(length - (HEADER - 4), dtype=np.uint8)
        if self.rank == 0:
            rest[:] = np.frombuffer(payload[HEADER - 4:], dtype=np.uint8)
        return first + self._all_sum(rest).tobytes()

    def agree(self, value: int) -> list[int]:
        """Every rank's `value` (a checksum), gathered by all_sum of one slot per rank."""
        slots = np.zeros(self.group.size(), dtype=np.int32)
        slots[self.rank] = value
        return [int(v) for v in self._all_sum(slots)]
