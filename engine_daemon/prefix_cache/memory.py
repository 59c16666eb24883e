"""The in-memory tier: KV caches of token prefixes, longest-prefix reuse, LRU within a byte cap.

Why our own and not mlx-lm's `LRUPromptCache`: evicted entries must go somewhere (the disk
tier) and every entry must be listable (spilled on a model switch or a clean shutdown),
which mlx-lm's class keeps private. Lookups compare token arrays with numpy: entries are
few (tens) and prompts long, so a scan is microseconds and needs no trie.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

T = TypeVar("T")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int32 token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def as_tokens(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def longest_prefix(candidates: Iterable[tuple[T, np.ndarray, bool]], tokens: np.ndarray) -> tuple[T, int] | None:
    """Of (item, its tokens, its KV trimmable) candidates, the one covering the most of `tokens`, and how much:
    a prefix of them, or a longer or diverging one whose KV can be cut back (every tier asks this)."""
    best: tuple[T, int] | None = None
    for item, held, trimmable in candidates:
        shared = common_prefix(held, tokens)
        if shared < len(held) and not trimmable:
            continue
        if shared and (best is None or shared > best[1]):
            best = (item, shared)
    return best


def trimmed_copy(cache: list[Any], length: int, shared: int) -> list[Any]:
    """A private copy of the KV of `length` tokens, cut to its first `shared`."""
    cache = copy.deepcopy(cache)
    if shared < length:
        trim_prompt_cache(cache, length - shared)
    return cache


@dataclass
class Entry:
    key: Hashable  # (model, adapter)
    tokens: np.ndarray
    cache: list[Any]
    nbytes: int
    plan_id: int | None = None  # an engine group's name for the entry on every rank (`PlannedPrefixCache`)
    at_prefill: bool = False  # shared when its prompt's prefill ended, while that request still ran


@dataclass
class Match:
    """The best reuse for a prompt: `length` prompt tokens covered by `entry`'s KV (trimmed when longer)."""

    entry: Entry
    length: int


class MemoryTier:
    def __init__(self, max_entries: int, max_bytes: int, on_evict: Callable[[Entry], None] | None = None):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.nbytes = 0
        self._entries: OrderedDict[tuple[Hashable, bytes], Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        """Most recently used first."""
        return list(reversed(self._entries.values()))

    def best_match(self, key: Hashable, tokens: np.ndarray) -> Match | None:
        """The entry covering the most of `tokens`: a prefix of them, or a longer entry that can be trimmed."""
        found = longest_prefix(((entry, entry.tokens, can_trim_prompt_cache(entry.cache))
                                for entry in self._entries.values() if entry.key == key), tokens)
        return Match(*found) if found is not None else None

    def take(self, match: Match) -> list[Any]:
        """A private copy of the match's KV, cut to the matched length; the entry becomes most recent."""
        entry = match.entry
        self._entries.move_to_end((entry.key, entry.tokens.tobytes()))
        return trimmed_copy(entry.cache, len(entry.tokens), match.length)

    def insert(self, key: Hashable, tokens: Sequence[int], cache: list[Any], at_prefill: bool = False) -> None:
        """Adds an entry; trimmable entries that are prefixes of it are dropped (it serves them all).

        A finished request's entry thus replaces the one its prompt published at the end of its
        prefill (`at_prefill`), so hits on `at_prefill` entries are hits while the publisher ran.
        """
        array = as_tokens(tokens)
        if not len(array) or not cache:
            return
        entry = Entry(key, array, cache, sum(c.nbytes for c in cache), at_prefill=at_prefill)
        self._drop((key, array.tobytes()))
        if can_trim_prompt_cache(cache):
            for other in [e for e in self._entries.values() if e.key == key and len(e.tokens) < len(array)]:
                if common_prefix(other.tokens, array) == len(other.tokens):
                    self._drop((key, other.tokens.tobytes()))
        self._entries[(key, array.tobytes())] = entry
        self.nbytes += entry.nbytes
        while self._entries and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            if self.on_evict is not None:
                self.on_evict(evicted)

    def clear(self) -> list[Entry]:
        """Empties the tier and returns what it held, most recent first."""
        held = self.entries()
        self._entries.clear()
        self.nbytes = 0
        return held

    def _drop(self, slot: tuple[Hashable, bytes]) -> None:
        old = self._entries.pop(slot, None)
        if old is not None:
            self.nbytes -= old.nbytes
