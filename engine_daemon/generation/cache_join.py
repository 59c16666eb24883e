"""Joining a newcomer's KV to the running batch's in one copy per tensor, on two CPU streams (on a CPU).

When a prompt's prefill ends, mlx-lm moves it into the decode batch with
`BatchKVCache.extend`: every layer's keys and values of the running streams and the
newcomer are left-padded to a common length (`mx.pad`, one copy) and stacked
(`mx.concatenate`, a second copy), one layer after another on the generation stream.
For a 1,500-token newcomer joining four streams of a small model that is ~70 ms of
copying inside one decode step: the running streams' longest gap of the whole prefill
(the stall-free pacer keeps every other step near its target).

`join_caches` builds the same arrays (same padding, same offsets, same buffer length)
with one zero-filled allocation and two slice writes per tensor, and spreads the layers
over two CPU streams so both cores copy: ~25 ms for the same join, started at once
(`mx.async_eval`) so it runs right behind the joining step's pass and not inside the
next one, without holding up the tokens that step hands back (a newcomer whose last
chunk ended in the joining step gets its first token from them). Caches it does not
know (quantized, rotating, pending right padding) keep mlx-lm's path.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine_daemon.generation.join_reserve import JoinReserve

_local = threading.local()  # MLX streams belong to the thread that made them (`mx.clear_streams` ends them)


def _copy_streams() -> list[Any]:
    """Two CPU streams on the CPU (both cores copy); the device's own stream on a GPU, where one copies fastest."""
    if mx.default_device() != mx.cpu:
        return [mx.default_stream(mx.default_device())]
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = [mx.new_stream(mx.cpu) for _ in range(2)]
    return streams


def joinable(running: list[Any], joining: list[Any]) -> bool:
    """Whether `join_caches` handles these two per-layer cache lists (else use mlx-lm's extend)."""
    if not running or not joining or len(running) != len(joining):
        return False
    for a, b in zip(running, joining):
        if type(a) is not BatchKVCache or type(b) is not BatchKVCache:
            return False
        if a.keys is None or b.keys is None or a._right_padding is not None or b._right_padding is not None:
            return False
        if a.keys.shape[1:2] != b.keys.shape[1:2] or a.keys.shape[3] != b.keys.shape[3]:
            return False
        if a.values.shape[3] != b.values.shape[3] or a.keys.dtype != b.keys.dtype:
            return False
    return True


def _join_tensor(first: mx.array, first_idx: int, second: mx.array, second_idx: int, size: int,
                 end: int, out: mx.array | None = None) -> mx.array:
    """(B1 + B2, H, size, D): each part's first `idx` positions right-aligned to `end`, zeros elsewhere.

    `out`: a zeroed buffer of that shape made beforehand (`JoinReserve`), written in place."""
    rows = first.shape[0]
    if out is None:
        out = mx.zeros((rows + second.shape[0], first.shape[1], size, first.shape[3]), dtype=first.dtype)
    out[:rows, :, end - first_idx:end] = first[:, :, :first_idx]
    out[rows:, :, end - second_idx:end] = second[:, :, :second_idx]
    return out


def join_caches(running: list[Any], joining: list[Any], reserve: JoinReserve | None = None) -> list[Any]:
    """`running` extended in place with `joining`, layer by layer (as `BatchKVCache.extend` leaves it).

    A layer whose buffers `reserve` made beforehand is written into them: their capacity may be
    larger than mlx-lm's (the room past `_idx` that a batch cache keeps for its next steps)."""
    streams = _copy_streams()
    for layer, (a, b) in enumerate(zip(running, joining)):
        end = max(a._idx, b._idx)
        size = max(a.keys.shape[2], b.keys.shape[2])
        rows = a.keys.shape[0] + b.keys.shape[0]
        made = reserve.take(layer, rows, end, a.keys, a.values) if reserve is not None else None
        if made is not None:
            size = made[0].shape[2]
        with mx.stream(streams[layer % len(streams)]):
            keys = _join_tensor(a.keys, a._idx, b.keys, b._idx, size, end, made[0] if made else None)
            values = _join_tensor(a.values, a._idx, b.values, b._idx, size, end, made[1] if made else None)
        a.left_padding = mx.concatenate([a.left_padding + (end - a._idx), b.left_padding + (end - b._idx)])
        a.offset = mx.concatenate([a.offset, b.offset])
        a.keys, a.values, a._idx = keys, values, end
    # Copy now, behind the step where the newcomer joins, rather than lazily inside the next decode step:
    # that step already pays for the newcomer's long rows, and two costs in one step make one long gap.
    mx.async_eval([(c.keys, c.values) for c in running])
    if reserve is not None:
        reserve.clear()
    return running


def own_kv(caches: list[Any]) -> list[KVCache] | None:
    """A lone prompt's KV from its own caches, as `BatchKVCache.extract` would give it from the joined batch.

    Why: sharing a prompt's KV the step it joined (`PrefillSharing`) took it out of the joined
    batch, whose new buffers are still being written (`join_caches`): mlx-lm's extract stops to
    evaluate the batch's padding in every layer, and the copy started behind the join's waited
    for it (15.8-16.9 ms on the ~85M CPU model after a 1,500-token prompt joined four streams,
    between two of their tokens). The prompt's own cache holds the same KV, the join's source,
    and a lazy slice of it holds up no in-place write of the batch's buffers
    (`StallFreeBatchGenerator.extract_cache`). None when these are not one-row `BatchKVCache`s.
    """
    if not caches or any(type(c) is not BatchKVCache or c.keys is None or c.keys.shape[0] != 1 for c in caches):
        return None
    extracted = []
    padding = int(caches[0].left_padding.tolist()[0])  # every layer's is the same; evaluated since the first chunk
    for cache in caches:
        own = KVCache()
        own.keys = mx.contiguous(cache.keys[:, :, padding:cache._idx])
        own.values = mx.contiguous(cache.values[:, :, padding:cache._idx])
        own.offset = own.keys.shape[2]
        extracted.append(own)
    return extracted
