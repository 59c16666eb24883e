"""join_caches: the same batch KV as mlx-lm's BatchKVCache.extend, built with one copy per tensor."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine_daemon.generation.cache_join import join_caches, joinable


def batch_cache(lengths: list[int], seed: int, heads: int = 2, dim: int = 8) -> BatchKVCache:
    """A batch cache of sequences with these lengths, as mlx-lm's merge builds it."""
    singles = []
    for i, length in enumerate(lengths):
        single = KVCache()
        key = mx.random.normal((1, heads, length, dim), key=mx.random.key(seed + i))
        single.update_and_fetch(key, key * 2 + 1)
        singles.append(single)
    merged = BatchKVCache.merge(singles)
    extra = mx.zeros((len(lengths), heads, 3, dim))  # a decode step or three: buffer room past _idx
    merged.update_and_fetch(extra + 5, extra + 6)
    return merged


def valid_rows(cache: BatchKVCache) -> list[tuple[list, list]]:
    """Each sequence's keys and values without its padding, as lists."""
    padding = cache.left_padding.tolist()
    return [(cache.keys[i, :, padding[i]:cache._idx].tolist(), cache.values[i, :, padding[i]:cache._idx].tolist())
            for i in range(cache.keys.shape[0])]


@pytest.mark.parametrize("running, joining", [([40, 7, 19], [300]), ([300, 12], [5, 60]), ([1], [1])])
def test_join_matches_mlx_lm_extend(running: list[int], joining: list[int]) -> None:
    layers = 3
    ours = [batch_cache(running, 10 * layer) for layer in range(layers)]
    theirs = copy.deepcopy(ours)
    newcomer = [batch_cache(joining, 100 + 10 * layer) for layer in range(layers)]
    assert joinable(ours, newcomer)
    join_caches(ours, copy.deepcopy(newcomer))
    for cache, other in zip(theirs, copy.deepcopy(newcomer)):
        cache.extend(other)
    for a, b in zip(ours, theirs):
        assert a._idx == b._idx
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
        assert a.left_padding.tolist() == b.left_padding.tolist()
        assert a.offset.tolist() == b.offset.tolist()
        assert valid_rows(a) == valid_rows(b)
        # Padding and unused room are zeros (attention masks them; zeros keep them finite).
        assert mx.all(mx.isfinite(a.keys)).item() and mx.all(mx.isfinite(a.values)).item()


def test_unknown_caches_keep_mlx_lms_path() -> None:
    cache = batch_cache([4], 0)
    assert not joinable([cache], [KVCache()])
    assert not joinable([], [cache])
    empty = BatchKVCache([0])
    assert not joinable([cache], [empty])
