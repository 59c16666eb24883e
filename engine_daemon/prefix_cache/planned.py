"""Rank 0's prompt cache in an engine group: every lookup, insert and eviction becomes a plan op.

Why rank 0 decides for all: each rank caches its own shard's KV (TP: half the heads; PP: its
layers), so byte-based LRU eviction run on every rank would drop different entries, and a
follower must never be told to reuse a prefix it no longer holds. Here only rank 0 looks up,
inserts and evicts (by its own bytes and entry count); each entry gets a `plan_id` carried in
the plan (`store` after the request that produced it finished, `evict` when it leaves, and the
id + matched length in the `add` that reuses it), so every rank's cache holds the same keys.
No disk tier: a follower cannot load what rank 0 spilled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine_daemon.prefix_cache.memory import as_tokens
from engine_daemon.prefix_cache.tiered import CacheKey, PrefixCache


class PlannedPrefixCache(PrefixCache):
    def __init__(self, max_entries: int, max_bytes: int, on_store: Callable[[int, int], None],
                 on_evict: Callable[[list[int]], None]):
        super().__init__(max_entries, max_bytes, disk=None)
        self.on_store, self.on_evict = on_store, on_evict  # (generator uid, plan id) / [plan ids]
        self._next_id = 0
        self._live: set[int] = set()

    def fetch_planned(self, key: CacheKey, prompt: Sequence[int]) -> tuple[list[Any] | None, int, int, int]:
        """(a private copy of the KV, prompt tokens it covers, the entry's plan id or -1, the entry's length)."""
        match = self.memory.best_match(key, as_tokens(prompt[:-1]))
        if match is None:
            return None, 0, -1, 0
        self.hits["memory"] += 1
        return self.memory.take(match), match.length, match.entry.plan_id, len(match.entry.tokens)

    def insert_planned(self, key: CacheKey, tokens: Sequence[int], cache: list[Any], uid: int) -> None:
        """Keeps a finished request's KV (generator `uid`); followers keep theirs under the same id."""
        self.memory.insert(key, tokens, cache)
        held = self.memory.entries()
        for entry in held:
            if entry.plan_id is None:
                entry.plan_id = self._next_id
                self._next_id += 1
                self._live.add(entry.plan_id)
                self.on_store(uid, entry.plan_id)
        self._forget({entry.plan_id for entry in held})

    def spill_all(self) -> int:
        self.memory.clear()
        self._forget(set())
        return 0

    def _forget(self, live: set[int | None]) -> None:
        gone = sorted(self._live - live)
        if gone:
            self._live -= set(gone)
            self.on_evict(gone)
