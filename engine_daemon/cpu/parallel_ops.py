"""Spreads MLX's single-threaded CPU element-wise work over several CPU streams.

On the CPU, MLX multiplies matrices on BLAS threads but runs every other op on
one thread per stream. In a float32 prefill the SwiGLU gate (`silu(gate) * up`,
an `exp` per element) and the attention softmax are ~40% of the time, with the
other cores idle. Each MLX stream has its own thread, so splitting those ops'
inputs along the batch (or sequence, or head) axis and running the parts on
separate streams puts the idle cores to work: a prefill of 8 x 125 tokens on the
Qwen2-0.5B-shaped bench model drops from ~6.5 s to ~5.4 s on 2 cores.

Every element is still computed by the same kernel on the same inputs, so the
outputs are bitwise identical to mlx-lm's (the cpu-parallel tests check it).
Model files bind `swiglu` and `scaled_dot_product_attention` by name when they
are imported, so `install()` rebinds those names in every imported
`mlx_lm.models.*` module after each load. Nothing changes on a GPU, where the
split functions call straight through, or when `--cpu-parallel-ops` is 1.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import mlx.core as mx
from mlx_lm.models import activations, base

from engine_daemon.cpu import decode_attention, prefill_attention, prefill_swiglu

log = logging.getLogger(__name__)

# Below this many elements the cross-stream hand-off costs more than it saves (decode steps stay whole).
MIN_ELEMENTS = 1 << 17
# SwiGLU's `exp` per element is dear enough that 16 rows of a 2,304-wide MLP already gain from the split
# (0.58 -> 0.32 ms on 2 cores; 8 rows lose, 0.26 -> 0.31): a prefill chunk beside running streams is that small.
MIN_SWIGLU_ELEMENTS = 1 << 15

_ORIGINAL_SWIGLU = activations.swiglu
_ORIGINAL_SDPA = base.scaled_dot_product_attention

_parts = 1
_local = threading.local()  # MLX streams belong to the thread that made them: one set per thread


def configure(parts: int) -> None:
    """How many CPU streams large element-wise ops are split over (1: off)."""
    global _parts
    _parts = max(1, int(parts))


def active_parts() -> int:
    """The streams a large op is split over here and now (1 on a GPU or when off), for /stats."""
    return _parts if _active() else 1


def install() -> int:
    """Rebinds the split functions in every imported mlx-lm model module; returns how many it changed.

    Also wraps mlx-lm's prompt processing so prompts' attention takes `prefill_attention`
    (through `split_sdpa`), in the same call so that no prefill path has one without the other.
    """
    prefill_attention.install()
    changed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm.models.") or module is None:
            continue
        for attr, original, split in (("swiglu", _ORIGINAL_SWIGLU, split_swiglu),
                                      ("scaled_dot_product_attention", _ORIGINAL_SDPA, split_sdpa)):
            if getattr(module, attr, None) is original:
                setattr(module, attr, split)
                changed += 1
    if changed:
        log.debug("cpu_parallel: %d model functions split over %d CPU streams", changed, _parts)
    return changed


def _streams(count: int) -> list[Any]:
    streams = getattr(_local, "streams", None)
    if streams is None or len(streams) < count:
        streams = [mx.new_stream(mx.cpu) for _ in range(count)]
        _local.streams = streams
    return streams[:count]


def _active() -> bool:
    return _parts > 1 and mx.default_device() == mx.cpu


def _slices(length: int, count: int) -> list[slice]:
    bounds = [length * i // count for i in range(count + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(count)]


def _index(axis: int, part: slice) -> tuple[Any, ...]:
    return (slice(None),) * axis + (part,)


def split_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu`, split along the first leading axis long enough to share out.

    A prompt's gate on the CPU goes to `prefill_swiglu` instead (`prefill_swiglu.claims`).
    """
    if prefill_swiglu.claims(gate, x):
        return prefill_swiglu.swiglu(gate, x)
    if not _active() or gate.size < MIN_SWIGLU_ELEMENTS or gate.shape != x.shape:
        return _ORIGINAL_SWIGLU(gate, x)
    axis = next((a for a in range(gate.ndim - 1) if gate.shape[a] >= 2), None)
    if axis is None:
        return _ORIGINAL_SWIGLU(gate, x)
    count = min(_parts, gate.shape[axis])
    results = []
    for stream, part in zip(_streams(count), _slices(gate.shape[axis], count)):
        with mx.stream(stream):
            results.append(_ORIGINAL_SWIGLU(gate[_index(axis, part)], x[_index(axis, part)]))
    return mx.concatenate(results, axis=axis)


_UNCUTTABLE = object()


def _mask_part(mask: Any, axis: int, part: slice, full: int) -> Any:
    """The mask for one part: sliced where it spans the split axis, shared where it broadcasts over it.

    An array mask broadcasts against (batch, heads, queries, keys) from the right.
    """
    if not isinstance(mask, mx.array):
        return mask  # None or "causal"
    dim = axis - (4 - mask.ndim)
    if dim < 0 or mask.shape[dim] == 1:
        return mask
    return mask[_index(dim, part)] if mask.shape[dim] == full else _UNCUTTABLE


SdpaPlan = tuple[int, list[slice], list[slice], list[Any]]  # axis, query parts, key/value parts, mask parts


def _sdpa_plan(queries: mx.array, keys: Any, cache: Any, mask: Any) -> SdpaPlan | None:
    """(axis, query parts, key/value parts, mask parts) to split attention along, or None to call through.

    Batches split by sequence; one sequence splits by key/value head groups (a group's query heads go with it).
    """
    if not _active() or hasattr(cache, "bits") or not isinstance(keys, mx.array):  # quantized KV: tuples
        return None
    batch, heads, length, _ = queries.shape
    kv_heads, key_length = keys.shape[1], keys.shape[2]
    if batch * heads * length * key_length < MIN_ELEMENTS or keys.shape[0] != batch:
        return None
    if batch >= 2:
        axis, full = 0, batch
        key_parts = query_parts = _slices(batch, min(_parts, batch))
    elif kv_heads >= 2 and heads % kv_heads == 0:
        axis, full, group = 1, heads, heads // kv_heads
        key_parts = _slices(kv_heads, min(_parts, kv_heads))
        query_parts = [slice(p.start * group, p.stop * group) for p in key_parts]
    else:
        return None
    masks = [_mask_part(mask, axis, part, full) for part in query_parts]
    if any(m is _UNCUTTABLE for m in masks):
        return None
    return axis, query_parts, key_parts, masks


def split_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
               mask: Any, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's attention, split over the batch, or over key/value head groups for one sequence.

    A prompt's attention on the CPU goes to `prefill_attention` instead (`prefill_attention.claims`), and so
    does a decode step's at a long context (`decode_attention.claims`).
    """
    if prefill_attention.claims(queries, keys, cache, mask, sinks) or \
            decode_attention.claims(queries, keys, cache, mask, sinks):
        return prefill_attention.attention(queries, keys, values, scale, mask)
    plan = _sdpa_plan(queries, keys, cache, mask)
    if plan is None:
        return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    axis, query_parts, key_parts, masks = plan
    results = []
    for stream, q_part, kv_part, part_mask in zip(_streams(len(query_parts)), query_parts, key_parts, masks):
        part_sinks = sinks if sinks is None or axis == 0 else sinks[q_part]
        with mx.stream(stream):
            results.append(mx.fast.scaled_dot_product_attention(
                queries[_index(axis, q_part)], keys[_index(axis, kv_part)], values[_index(axis, kv_part)],
                scale=scale, mask=part_mask, sinks=part_sinks))
    return mx.concatenate(results, axis=axis)
