"""Prompt logprobs already computed, by token prefix: a prompt sharing a scored prefix is scored from its end.

Why: evaluation harnesses score many prompts that share most of their tokens. lm-evaluation-harness's
multiple-choice tasks send one request per choice, each the same context with another continuation,
and few-shot tasks put the same examples before every question. A prompt token's logprob depends only
on the tokens before it, so over a shared prefix every request would compute the same numbers again.
Kept here (and the prefix's KV in the prefix cache, `PromptScoring`), a later prompt computes only
what follows the longest prefix scored before. Keyed as the prefix cache is (the model's identity and
KV layout, the adapter); least recently used first out, within an entry count and a byte cap.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from engine_daemon.prefix_cache.memory import as_tokens, common_prefix

MAX_ENTRIES = 256
MAX_BYTES = 32 << 20


@dataclass
class ScoredPrefix:
    """A scored prompt: row i holds what the model gave `tokens[i + 1]` after `tokens[:i + 1]`."""

    key: Hashable
    tokens: np.ndarray  # int32
    chosen: np.ndarray  # float32 (len(tokens) - 1,): each token's own logprob
    top_ids: np.ndarray  # int32 (len(tokens) - 1, top): the most likely tokens there, most likely first
    top_values: np.ndarray  # float32, the same shape: their logprobs

    @property
    def top(self) -> int:
        return int(self.top_ids.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self.chosen.nbytes + self.top_ids.nbytes + self.top_values.nbytes)

    @classmethod
    def of(cls, key: Hashable, tokens: list[int], chosen: list[float], ids: list[list[int]],
           values: list[list[float]], top: int) -> ScoredPrefix:
        """From a scoring pass's rows (`logprob_rows`: alternatives in any order), most likely first."""
        rows = len(chosen)
        top_ids = np.asarray(ids, dtype=np.int32).reshape(rows, top)
        top_values = np.asarray(values, dtype=np.float32).reshape(rows, top)
        order = np.argsort(-top_values, axis=1, kind="stable")
        return cls(key, as_tokens(tokens[:rows + 1]), np.asarray(chosen, dtype=np.float32),
                   np.take_along_axis(top_ids, order, axis=1), np.take_along_axis(top_values, order, axis=1))


class ScoredPrefixes:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[Hashable, bytes], ScoredPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, key: Hashable, tokens: list[int], top: int) -> tuple[ScoredPrefix, int] | None:
        """The entry sharing the most leading tokens with `tokens` among those listing at least `top`
        alternatives per token, and how many tokens it shares (None: none shares two, so none has a row)."""
        array = as_tokens(tokens)
        best: tuple[ScoredPrefix, int] | None = None
        for entry in self._entries.values():
            if entry.key != key or entry.top < top:
                continue
            shared = common_prefix(entry.tokens, array)
            if shared >= 2 and (best is None or shared > best[1]):
                best = (entry, shared)
        if best is not None:
            self._entries.move_to_end((key, best[0].tokens.tobytes()))
        return best

    def insert(self, entry: ScoredPrefix) -> None:
        """Adds a scored prompt; entries it extends with as many alternatives or fewer are dropped (it serves them)."""
        if len(entry.tokens) < 2 or entry.nbytes > self.max_bytes:
            return
        slot = (entry.key, entry.tokens.tobytes())
        for other_slot, other in list(self._entries.items()):
            if other_slot == slot or (other.key == entry.key and other.top <= entry.top
                                      and len(other.tokens) <= len(entry.tokens)
                                      and common_prefix(other.tokens, entry.tokens) == len(other.tokens)):
                self._drop(other_slot)
        self._entries[slot] = entry
        self.nbytes += entry.nbytes
        while self._entries and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, slot: tuple[Hashable, bytes]) -> None:
        old = self._entries.pop(slot, None)
        if old is not None:
            self.nbytes -= old.nbytes
