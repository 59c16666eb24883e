"""join_caches: the same batch KV as mlx-lm's BatchKVCache.extend, built with one copy per tensor."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine_daemon.generation.cache_join import join_caches, joinable
from engine_daemon.generation.join_reserve import JoinReserve


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


def test_join_into_reserved_buffers_matches_a_fresh_join() -> None:
    """Buffers made ahead (`JoinReserve`) hold the same rows as a fresh join, with the reserve's capacity."""
    layers, running_lengths, joining_length = 3, [40, 7, 19], 300
    ours = [batch_cache(running_lengths, 10 * layer) for layer in range(layers)]
    plain = copy.deepcopy(ours)
    newcomer = [batch_cache([joining_length], 100 + 10 * layer) for layer in range(layers)]
    reserve = JoinReserve(layers_per_step=2, enabled=True)
    mx.reset_peak_memory()  # the join takes the process past the most memory it has held: buffers are made ahead
    reserve.prepare(7, ours, newcomer, remaining=0)
    assert reserve.layers_ready == 2  # a few layers per step, not all at once
    reserve.prepare(7, ours, newcomer, remaining=0)
    assert reserve.layers_ready == 3
    reserved_size = reserve._buffers[0][0].shape[2]
    assert reserved_size >= newcomer[0]._idx and reserved_size % 256 == 0
    join_caches(ours, copy.deepcopy(newcomer), reserve)
    join_caches(plain, copy.deepcopy(newcomer))
    assert reserve.layers_ready == 0 and reserve.uid is None
    for a, b in zip(ours, plain):
        assert a.keys.shape[2] == reserved_size and a.values.shape[2] == reserved_size
        assert a._idx == b._idx and a.left_padding.tolist() == b.left_padding.tolist()
        assert a.offset.tolist() == b.offset.tolist()
        assert valid_rows(a) == valid_rows(b)
        assert mx.all(a.keys[..., a._idx:, :] == 0).item()  # the room past the join is zeros, as mlx-lm's


def test_a_step_makes_at_most_its_bytes_of_buffers_and_the_join_is_still_exact() -> None:
    """Wide KV (an 8B model's 126 MB a layer at a 3,000-token join) made two layers a step stalled those steps
    1.1-1.6 s: a step now makes at most `bytes_per_step` (one buffer at least), a layer's keys and values over
    two steps if need be, and the join into those buffers is the same as a fresh one."""
    layers, running_lengths, joining_length = 2, [40, 7, 19], 300
    ours = [batch_cache(running_lengths, 10 * layer) for layer in range(layers)]
    plain = copy.deepcopy(ours)
    newcomer = [batch_cache([joining_length], 100 + 10 * layer) for layer in range(layers)]
    one_buffer = 4 * 2 * 512 * 8 * 4  # (4 rows, 2 heads, 512 positions, 8 dims) float32
    reserve = JoinReserve(layers_per_step=2, enabled=True, bytes_per_step=one_buffer)
    mx.reset_peak_memory()
    made = []
    for _ in range(5):
        reserve.prepare(7, ours, newcomer, remaining=200)
        made.append(reserve.layers_ready)
    assert made == [0, 1, 1, 2, 2]  # one buffer a step: keys, then values, of each layer
    assert reserve._buffers[0][0].nbytes == one_buffer
    join_caches(ours, copy.deepcopy(newcomer), reserve)
    join_caches(plain, copy.deepcopy(newcomer))
    for a, b in zip(ours, plain):
        assert a._idx == b._idx and valid_rows(a) == valid_rows(b)
    five_rows = 5 * 2 * 512 * 8 * 4  # the joined batch has four rows now: buffers of five
    half = JoinReserve(layers_per_step=2, enabled=True, bytes_per_step=3 * five_rows - 1)
    half.prepare(8, plain, newcomer, remaining=200)
    assert half.layers_ready == 1 and not half._keys  # two buffers fit under the cap, a third would not


def test_reserve_that_does_not_fit_is_not_used() -> None:
    """A batch that changed since the buffers were made (a stream left) joins into fresh buffers."""
    ours = [batch_cache([40, 7, 19], 10 * layer) for layer in range(2)]
    newcomer = [batch_cache([30], 100 + 10 * layer) for layer in range(2)]
    reserve = JoinReserve(layers_per_step=4, enabled=True)
    mx.reset_peak_memory()
    reserve.prepare(1, ours, newcomer, remaining=0)
    smaller = [batch_cache([40, 7], 10 * layer) for layer in range(2)]
    join_caches(smaller, copy.deepcopy(newcomer), reserve)
    assert smaller[0].keys.shape[0] == 3 and smaller[0].keys.shape[2] == max(c.keys.shape[2] for c in
                                                                            (ours[0], newcomer[0]))
    reserve.prepare(1, ours, newcomer, remaining=0)
    mx.reset_peak_memory()
    reserve.prepare(2, ours, newcomer, remaining=500)  # another prompt, or a longer one: start over
    assert reserve.uid == 2 and reserve._buffers[0][0].shape[2] >= newcomer[0]._idx + 500
    reserve.forget([2])
    assert reserve.layers_ready == 0


def test_no_buffers_are_made_below_the_most_memory_held() -> None:
    """A join the process has had the memory for before needs no buffers made ahead: its pages are reused."""
    ours = [batch_cache([40, 7], 10 * layer) for layer in range(2)]
    newcomer = [batch_cache([30], 100 + 10 * layer) for layer in range(2)]
    held = mx.zeros((4 << 20,))  # 16 MB, far more than the join's buffers
    mx.eval(held)
    del held
    reserve = JoinReserve(layers_per_step=4, enabled=True)
    reserve.prepare(3, ours, newcomer, remaining=0)
    assert reserve.uid == 3 and reserve.layers_ready == 0
    join_caches(ours, copy.deepcopy(newcomer), reserve)
    assert ours[0].keys.shape[0] == 3


def test_caches_that_join_caches_leaves_to_mlx_lm_get_no_buffers() -> None:
    """Quantized or other caches keep mlx-lm's extend: nothing is made for them."""
    reserve = JoinReserve(enabled=True)
    mx.reset_peak_memory()
    reserve.prepare(4, [KVCache()], [batch_cache([5], 1)], remaining=10)
    reserve.prepare(4, [batch_cache([5], 1)], [BatchKVCache([0])], remaining=10)
    assert reserve.layers_ready == 0
