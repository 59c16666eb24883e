"""The vision models' prefix cache: mlx-vlm's block cache in memory, our `DiskTier` on disk.

Vision models prefill through mlx-vlm, whose automatic prefix cache (`mlx_vlm.apc.APCManager`)
keeps prompts' KV as hash-chained 16-token blocks in memory. `TieredAPCManager` is that manager
with the text models' disk tier (`disk.DiskTier`, the same `--prompt-cache-dir`) behind it:

* writing: the prompts whose blocks are stored are remembered (token ids and media salt, no
  tensors); when mlx-vlm evicts one of their blocks, or the generator closes (a model switch,
  a clean shutdown), each such prompt's resident block chain is written as one entry;
* reading: mlx-vlm asks `lookup_prefix_disk_cache` whenever memory does not cover a prompt;
  the longest stored entry for (model identity, adapter, media salt) comes back as a warm
  cache, which mlx-vlm prefills the rest of the prompt on.

Why not mlx-vlm's own `DiskBlockStore` (`disk_enabled`): its files carry no checksum, so a
flipped byte in a tensor is served as KV; its byte cap is counted per process and per model
namespace, so two engines (or two models) on one directory each fill it to the cap; an engine
starting deletes every file whose name is not canonical, which includes the temporary file
another engine is writing; and its block hashes default to Python's `hash`. `DiskTier` checks
a content hash on every load (a damaged file is logged, deleted, never served), writes to a
temporary name and renames, and keeps the whole directory (text and vision entries together)
under `--prompt-cache-disk-bytes`.

Entries may hold image tokens. mlx-vlm refuses a memory block prefix that contains media, but
its warm-cache restore path (which this tier feeds) takes a prefix that covers every media
token of the prompt, and only such a prefix is served here. That is sound for Qwen2-VL-style
M-RoPE because the positions are not state of the entry: the engine computes the whole prompt's
`position_ids` and `rope_deltas` from the token ids and the image grids on every request
(`get_input_embeddings`) and mlx-vlm slices them to the uncached suffix. The KV of an image's
tokens depends on the image's pixels, which the token ids do not name; the media salt (content
hashes of the prompt's images in order, `VisionInputs.media_keys`) is part of every entry's key,
so one image's KV never answers for another.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from mlx_vlm.apc import (
    SEED_PARENT_HASH,
    APCManager,
    _hash_tokens,
    make_warm_kv_cache_from_layers,
    media_safe_prefix_min,
)

from engine_daemon.prefix_cache.disk import DiskTier, key_digest

log = logging.getLogger(__name__)

MAX_REMEMBERED_PROMPTS = 256  # prompts whose blocks may be in memory; older ones are left to mlx-vlm

_TIERS: dict[str, DiskTier] = {}


def shared_disk_tier(directory: str | None, max_bytes: int) -> DiskTier | None:
    """The vision generators' `DiskTier` on `--prompt-cache-dir`, one per process.

    One instance outlives the generators (one per loaded model) so its counters and its
    measured read speed survive a model switch. It shares the directory, file format and byte
    cap with the text models' tier: the cap holds for the whole directory, as it does for two
    engines sharing it (each tier re-reads the directory when it changed).
    """
    if not directory:
        return None
    tier = _TIERS.get(directory)
    if tier is None:
        tier = _TIERS[directory] = DiskTier(directory, max_bytes)
    return tier


def entry_key(model_identity: str, adapter: str | None, media_salt: int) -> str:
    """The disk key of a vision prefix: the weights, the adapter, the prompt's media."""
    base = key_digest(model_identity, adapter)
    return hashlib.sha256(f"vision-apc:{base}:{media_salt}".encode()).hexdigest()


class _EvictionWatch(dict):
    """mlx-vlm's block hash table, telling its owner about a block before it leaves.

    mlx-vlm evicts in two places (`_evict_lru`, `_make_room`), both by removing the block's hash
    from `hash_table` while its tensors are still attached: hooking the removal sees every
    eviction without copying mlx-vlm's eviction code.
    """

    def __init__(self, on_remove: Any):
        super().__init__()
        self._on_remove = on_remove

    def __delitem__(self, key: int) -> None:
        self._on_remove(key)
        super().__delitem__(key)

    def pop(self, key: int, *default: Any) -> Any:
        if key in self:
            self._on_remove(key)
        return super().pop(key, *default)


class TieredAPCManager(APCManager):
    def __init__(self, memory_bytes: int, disk: DiskTier | None, model_identity: str,
                 media_token_ids: set[int], adapter: str | None = None):
        # mlx-vlm's disk tier stays off: ours is `disk` (see the module docstring).
        super().__init__(overrides={"memory_max_gb": memory_bytes / (1 << 30), "disk_enabled": False})
        self.tier = disk
        self.model_identity = model_identity
        self.adapter = adapter
        self.media_token_ids = media_token_ids
        # (media salt, block-aligned tokens) -> their block hashes, most recent last.
        self._prompts: OrderedDict[tuple[int, tuple[int, ...]], list[int]] = OrderedDict()
        self._spilling = False
        if disk is not None:
            self.hash_table = _EvictionWatch(self._block_leaving)

    # -- writing ---------------------------------------------------------------------------------
    def store_kv_blocks(self, token_ids: Sequence[int], layer_keys: list[mx.array], layer_values: list[mx.array],
                        *, extra_hash: int = 0, skip_first_n_tokens: int = 0) -> list[Any]:
        """Stores the prompt's blocks, and remembers the prompt for the disk tier.

        mlx-vlm skips the blocks of the prefix the prompt reused; when that prefix came from disk
        those blocks are not in memory, so all of them are stored: the prompt's chain must be
        resident in full to be written back (and memory then serves it without reading disk).
        """
        hashes = self._chain(token_ids, extra_hash)
        skip = skip_first_n_tokens
        if self.tier is not None and skip:
            with self.lock:
                if any(h not in self.hash_table for h in hashes[:skip // self.block_size]):
                    skip = 0
        blocks = super().store_kv_blocks(token_ids, layer_keys, layer_values, extra_hash=extra_hash,
                                         skip_first_n_tokens=skip)
        if self.tier is not None:
            self._remember(token_ids, extra_hash, hashes)
        return blocks

    def _chain(self, token_ids: Sequence[int], salt: int) -> list[int]:
        """mlx-vlm's block hashes of the prompt's whole blocks."""
        hashes, parent, size = [], SEED_PARENT_HASH, self.block_size
        for start in range(0, len(token_ids) // size * size, size):
            parent = _hash_tokens(parent, tuple(int(t) for t in token_ids[start:start + size]), salt)
            hashes.append(parent)
        return hashes

    def _remember(self, token_ids: Sequence[int], salt: int, hashes: list[int]) -> None:
        """Notes a stored prompt; prompts it extends (same salt) are dropped: its entry serves them."""
        tokens = tuple(int(t) for t in token_ids[:len(hashes) * self.block_size])
        if len(tokens) < self.tier.min_tokens:
            return
        with self.lock:
            for other in [k for k in self._prompts if k[0] == salt and len(k[1]) <= len(tokens)]:
                if tokens[:len(other[1])] == other[1]:
                    del self._prompts[other]
            self._prompts[(salt, tokens)] = hashes
            while len(self._prompts) > MAX_REMEMBERED_PROMPTS:
                self._prompts.popitem(last=False)

    def _block_leaving(self, block_hash: int) -> None:
        """mlx-vlm evicts a block: every remembered prompt holding it goes to disk first."""
        if self._spilling:
            return
        for key in [k for k, hashes in self._prompts.items() if block_hash in hashes]:
            self._spill(key, self._prompts.pop(key), later=True)

    def spill_all(self) -> int:
        """Writes every remembered prompt still in memory (a model switch, a clean shutdown)."""
        if self.tier is None:
            return 0
        self.tier.flush()  # evictions still being written first
        with self.lock:
            held = list(reversed(self._prompts.items()))
            self._prompts.clear()
            written = sum(1 for key, hashes in held if self._spill(key, hashes))
        if written:
            log.info("vision prompt cache: %d of %d prefixes written to %s", written, len(held), self.tier.directory)
        return written

    def _spill(self, key: tuple[int, tuple[int, ...]], hashes: list[int], later: bool = False) -> bool:
        """One prompt's resident block chain as one `DiskTier` entry (mlx-lm `KVCache` per layer); `later`:
        written on the tier's writer thread (an eviction: no stream waits for the disk)."""
        salt, tokens = key
        blocks = []
        for index, block_hash in enumerate(hashes):
            block = dict.get(self.hash_table, block_hash)
            expected = tokens[index * self.block_size:(index + 1) * self.block_size]
            if block is None or block.token_ids != expected or block.keys is None:
                break
            blocks.append(block)
        length = len(blocks) * self.block_size
        if length < self.tier.min_tokens:
            return False
        caches = []
        for layer in range(len(blocks[0].keys)):
            cache = KVCache()
            cache.keys = mx.concatenate([b.keys[layer] for b in blocks], axis=2)
            cache.values = mx.concatenate([b.values[layer] for b in blocks], axis=2)
            cache.offset = length
            caches.append(cache)
        self._spilling = True  # a write never evicts, but stay safe against re-entry
        try:
            store = self.tier.store_later if later else self.tier.store
            stored = store(entry_key(self.model_identity, self.adapter, salt),
                           np.asarray(tokens[:length], dtype=np.int32), caches, trimmable=True)
        finally:
            self._spilling = False
        return stored

    # -- reading ---------------------------------------------------------------------------------
    def lookup_prefix_disk_cache(self, token_ids: Sequence[int], extra_hash: int = 0,
                                 max_prefix_tokens: int | None = None, min_prefix_tokens: int = 0,
                                 allow_memory_overlap: bool = False) -> tuple[list[Any] | None, int]:
        """The longest stored prefix of `token_ids` that mlx-vlm can use: longer than what memory
        covers (`min_prefix_tokens`), shorter than the prompt, covering every media token."""
        if self.tier is None or len(token_ids) < 2:
            return None, 0
        limit = len(token_ids) - 1
        if max_prefix_tokens:
            limit = min(limit, int(max_prefix_tokens))
        tokens = np.asarray(token_ids[:limit], dtype=np.int32)
        floor = max(int(min_prefix_tokens), media_safe_prefix_min(token_ids, self.media_token_ids) - 1)
        key = entry_key(self.model_identity, self.adapter, extra_hash)
        found = self.tier.best_match(key, tokens, 0)
        queued = self.tier.pending_match(key, tokens)  # evicted, its file not written yet: still in memory
        if queued is not None and queued[1] > floor and (found is None or queued[1] >= found[1]):
            spill, shared = queued
            caches = spill.cache  # only sliced below: the writer's arrays are never changed
        else:
            if found is None or found[1] <= floor:
                return None, 0
            entry, shared = found
            caches = self.tier.load(entry)
            if caches is None:
                return None, 0  # damaged (logged and deleted by the tier) or gone: prefill instead
        keys = [c.keys[..., :shared, :] for c in caches]
        values = [c.values[..., :shared, :] for c in caches]
        warm = make_warm_kv_cache_from_layers(keys, values, shared)
        self._prefill_reserve_bytes = self.memory_plan.observe_cache(warm, shared)  # as mlx-vlm's own restore
        return warm, shared  # mlx-vlm's own counters stay memory-only: /stats reports the tiers apart

    def tier_stats(self) -> dict[str, int]:
        """The vision tier's counters since the engine started (the tier outlives model switches)."""
        if self.tier is None:
            return {}
        return {"vision_kv_disk_hits": self.tier.hits, "vision_kv_disk_tokens_loaded": self.tier.tokens_loaded,
                "vision_kv_disk_writes": self.tier.writes, "vision_kv_disk_corrupt": self.tier.corrupt}
