"""The step plan: everything a follower rank needs to do exactly what rank 0's generator did.

Why ops and not requests: followers never see the front-end, the tokenizer's work or the
admission rules; they only need the generator calls, in rank 0's order (inserts with the
prompt tokens, sampling settings and the seed rank 0 drew; removals), the prefill chunk
size rank 0's pacer chose from its own clock, and whether to step. Anything that depends
on one rank's clock or memory is thus decided once, on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

PLAN_VERSION = 3


@dataclass
class AddOp:
    """One `insert` into the generator: rank 0's uid, the prompt's uncached rest, limit, sampling (seed
    included), eos ids; and the prompt-cache entry rank 0 reused (`entry` -1: none) for the first `cached`
    tokens, cut back from the entry's `entry_len` tokens; `processors`: the spec rank 0 built the request's
    own logits processors from (`build_processors`), None when it has none."""

    uid: int
    prompt: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    eos: list[int]
    cached: int = 0
    entry: int = -1
    entry_len: int = 0
    processors: dict[str, Any] | None = None


@dataclass
class StepPlan:
    """One tick. `ops` are applied in order before the step; then `step` runs generator.next()."""

    tick: int
    # ("add", AddOp) | ("remove", [uids]) | ("store", [uid, entry]): keep the KV of uid (finished in the last
    # step) as prompt-cache entry `entry` | ("evict", [entries])
    ops: list[tuple[str, Any]] = field(default_factory=list)
    prefill_step_size: int = 2048
    step: bool = False
    checksum: bool = False  # after the step, every rank agrees on the token checksum (`checksum`)
    idle: bool = False  # after this plan, followers wait for a wake instead of the next plan
    stop: bool = False  # the group shuts down cleanly

    def encode(self) -> bytes:
        ops = [["add", [op.uid, op.prompt, op.max_tokens, op.sampling, op.eos, op.cached, op.entry, op.entry_len,
                        op.processors]]
               if kind == "add" else [kind, op]
               for kind, op in self.ops]
        return msgpack.packb([PLAN_VERSION, self.tick, ops, self.prefill_step_size, self.step, self.checksum,
                              self.idle, self.stop], use_bin_type=True)

    @classmethod
    def decode(cls, payload: bytes) -> StepPlan:
        version, tick, ops, prefill, step, checksum, idle, stop = msgpack.unpackb(
            payload, raw=False, strict_map_key=False)
        if version != PLAN_VERSION:
            raise ValueError(f"step plan version {version}, expected {PLAN_VERSION}")
        decoded: list[tuple[str, Any]] = []
        for kind, op in ops:
            if kind == "add":
                decoded.append(("add", AddOp(*op)))
            elif kind in ("remove", "store", "evict"):
                decoded.append((kind, list(op)))
            else:
                raise ValueError(f"unknown step plan op {kind!r}")
        return cls(tick, decoded, prefill, step, checksum, idle, stop)
