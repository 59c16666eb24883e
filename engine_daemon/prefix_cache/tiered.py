"""The prefix cache the scheduler asks: memory first, then disk, with counters per tier.

Keys are (model identity, adapter): the identity (`model_identity`) names the weights on
disk, not the name a request used, so a prefix stored under one alias serves another alias
of the same files, and a file stored before the weights changed is never served after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from engine_daemon.prefix_cache.disk import DiskTier, key_digest
from engine_daemon.prefix_cache.disk_reads import DiskReads
from engine_daemon.prefix_cache.kv_layout import Layout, model_layout
from engine_daemon.prefix_cache.memory import Entry, MemoryTier, as_tokens, trimmed_copy

log = logging.getLogger(__name__)

CacheKey = tuple[str, "str | None"]  # (model identity and KV layout: `layout_key`, adapter key)


def layout_key(model_identity: str, max_kv_size: int | None) -> str:
    """The identity a prefix's KV is keyed on: the weights', and the cache's layout when it is not the plain one.

    Why: `--max-kv-size` makes rotating caches; a plain cache from the disk tier, written by a run without it,
    joined into a rotating batch failed the whole step (every stream in it) after such a restart.
    """
    return model_identity if not max_kv_size else f"{model_identity}:rotating-{max_kv_size}"


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int, disk: DiskTier | None = None,
                 model: Callable[[], Any] | None = None, max_kv_size: int | None = None):
        """`model`: the loaded model, whose KV layout (`kv_layout`) a disk entry must have to be used."""
        self.disk = disk
        self.model, self.max_kv_size = model, max_kv_size
        self._layouts: dict[str, Layout] = {}  # by the key's identity and layout: one model call per model
        self.memory = MemoryTier(max_entries, max_bytes, on_evict=self._spill)
        self.hits = {"memory": 0, "disk": 0, "in_flight": 0}
        self.prefill_tokens_per_second: float | None = None  # measured by the scheduler
        self.reads = DiskReads()  # disk entries read ahead of their prompts' admission

    def __len__(self) -> int:
        return len(self.memory)

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill-only step's speed: what a disk load must beat."""
        if tokens >= 64 and seconds > 0:
            rate, old = tokens / seconds, self.prefill_tokens_per_second
            self.prefill_tokens_per_second = rate if old is None else old + 0.3 * (rate - old)

    def fetch(self, key: CacheKey, prompt: Sequence[int], wait: bool = True) -> tuple[list[Any] | None, int]:
        """A private copy of the KV of the longest known prefix of `prompt`, and its length.

        At least the prompt's last token is left to compute (its logits give the first token).
        `wait=False`: memory only; nothing is read from disk, waited for, or taken from the reads begun
        ahead. Why: a prompt-scoring job starts on the mlx thread between steps without waiting in the
        queue (`PromptScoring`), and took over another request's running read, so every stream waited
        for the disk; a finished read it took was another prompt's, which then read again (on the mlx
        thread with `KEEP_READS` held). The job prefills instead, in the slices its budget allows.
        """
        tokens = as_tokens(prompt[:-1])
        match, queued, reused = self._in_memory(key, tokens)
        stored = self._on_disk(key, tokens, reused, counted=True) if wait else None
        if stored is not None:
            entry, shared, read = stored
            cache = self.reads.take(entry, read)
            if cache is not None:
                if shared < len(entry.tokens):
                    trim_prompt_cache(cache, len(entry.tokens) - shared)
                self.hits["disk"] += 1
                return cache, shared
        if queued is not None:  # evicted and still being written: its arrays are in memory yet
            spill, shared = queued
            self.hits["memory"] += 1
            return trimmed_copy(spill.cache, len(spill.tokens), shared), shared
        if match is None:
            return None, 0
        self.hits["in_flight" if match.entry.at_prefill else "memory"] += 1
        return self.memory.take(match), match.length

    def reading(self, key: CacheKey, prompt: Sequence[int]) -> bool:
        """Whether `prompt`'s longest known prefix is on disk and being read for it (`DiskReads`, started here):
        it waits to be admitted, and `fetch` then takes that read. False when nothing on disk is worth reading."""
        if self.disk is None or len(prompt) <= self.disk.min_tokens:
            return False
        tokens = as_tokens(prompt[:-1])
        stored = self._on_disk(key, tokens, self._in_memory(key, tokens)[2])
        return stored is not None and self.reads.ahead(stored[0], stored[2])

    def _on_disk(self, key: CacheKey, tokens: Any, reused: int, counted: bool = False) -> tuple[Any, int, Any] | None:
        """(the disk entry covering more of `tokens` than `reused` that is worth reading (one begun ahead always
        is), how much, its read), or None; `counted`: entries passed over for being slower count (`skipped_slower`)."""
        stored = self.disk.best_match(key_digest(*key), tokens, reused) if self.disk is not None else None
        if stored is None:
            return None
        entry, shared = stored
        worth = self.disk.worth_loading if counted else self.disk.faster_to_load
        if not (self.reads.holds(entry) or worth(entry, shared - reused, self.prefill_tokens_per_second)):
            return None
        layout = self._layout(key[0])
        return entry, shared, lambda: self.disk.load(entry, layout)

    def _in_memory(self, key: CacheKey, tokens: Any) -> tuple[Any, Any, int]:
        """(the memory tier's match, an evicted entry's still being written if longer, the longer one's length)."""
        match = self.memory.best_match(key, tokens)
        in_memory = match.length if match is not None else 0
        queued = self.disk.pending_match(key_digest(*key), tokens) if self.disk is not None else None
        if queued is not None and queued[1] <= in_memory:
            queued = None
        return match, queued, queued[1] if queued is not None else in_memory

    def _layout(self, identity: str) -> Layout | None:
        if self.model is None:
            return None
        if identity not in self._layouts:
            self._layouts[identity] = model_layout(self.model(), self.max_kv_size)
        return self._layouts[identity]

    def insert(self, key: CacheKey, tokens: Sequence[int], cache: list[Any], at_prefill: bool = False) -> None:
        """Keeps `cache` as the KV of `tokens`; `at_prefill`: shared by a request still running."""
        self.memory.insert(key, tokens, cache, at_prefill=at_prefill)

    def spill_all(self) -> int:
        """Empties memory into the disk tier (a model switch, a clean shutdown); returns files written.

        Evictions still being written go first (`DiskTier.flush`), then these, here: the switch or the
        stop waits for them, as it should (no stream runs), and the next start finds them all."""
        held = self.memory.clear()
        self.reads.close()
        if self.disk is None:
            return 0
        self.disk.flush()
        written = sum(1 for entry in held if self._spill(entry, now=True))
        if written:
            log.info("prompt cache: %d of %d entries written to %s", written, len(held), self.disk.directory)
        return written

    def _spill(self, entry: Entry, now: bool = False) -> bool:
        """Writes an evicted entry: on the disk tier's writer thread (an eviction, on the mlx thread), or `now`."""
        if self.disk is None:
            return False
        store = self.disk.store if now else self.disk.store_later
        return store(key_digest(*entry.key), entry.tokens, entry.cache, can_trim_prompt_cache(entry.cache))

    def stats(self) -> dict[str, int]:
        found = {"prompt_cache_entries": len(self.memory), "prompt_cache_bytes": self.memory.nbytes,
                 "prompt_cache_memory_hits": self.hits["memory"], "prompt_cache_disk_loads": self.hits["disk"],
                 "prompt_cache_in_flight_hits": self.hits["in_flight"]}
        found["prompt_cache_disk_reads_ahead"] = self.reads.started
        return {**found, **(self.disk.stats() if self.disk is not None else {})}
