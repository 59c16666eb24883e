"""Attention for prompt prefill on the CPU, with the softmax's `exp` done by NumPy.

Why: on the CPU, MLX's attention (`mx.fast.scaled_dot_product_attention` falls back to
matmul, mask, softmax, matmul) spends most of its time in `exp`, which MLX's x86 build
runs one element at a time (~12 ns per score here; NumPy's AVX2/AVX-512 `exp` takes
~0.5 ns). For a prompt of a few thousand tokens every query scores every earlier key,
so this one function is most of a long prefill: 60% of a 48-token chunk at 1,400
tokens of context on the ~85M bench model. It also decides how many prompt tokens fit
in a step beside running streams (`PrefillPacer` sizes chunks by time), and small
chunks are the dear ones: each reads every weight once.

How: the query heads that share a key/value head are folded into the rows of one
matrix product (GQA without broadcasting keys), the scores are evaluated, masked,
exponentiated and reduced in NumPy, and the probabilities go back to MLX for the
product with the values. A column of ones appended to the values makes that product
return each row's normaliser beside its output, so the row sums come from the same
BLAS product as the outputs and the division happens on the small output. Causal
queries are taken in blocks that each see only the keys up to their last row, which
also bounds the scores' memory.

Work marked `prefilling` takes this path: mlx-lm's `PromptProcessingBatch.prompt` once
`install` has wrapped it, and both attentions of a fused step (`fused_forward`: its chunk's,
and its decode rows', since that pass stops at every layer for the chunk anyway;
`evaluated_together` then evaluates both layers' scores at once). So does a plain decode
step's once its scores are many (`decode_attention`); shorter decode steps keep MLX's
attention and their asynchronous evaluation. A prompt token is computed the same way
whichever chunk it landed in. Results match MLX's to float rounding (~1e-7), not bitwise:
`--cpu-prefill-attention mlx` keeps MLX's. Nothing changes on a GPU, with quantized KV
caches or attention sinks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import PromptProcessingBatch

from engine_daemon.cpu.prefill_scope import PathSwitch, active, in_two, prefilling

# Scores held at once per block (float32): 32 MB. Larger prompts are taken in blocks of queries.
BLOCK_SCORES = 1 << 23
# From this many scores the exponentials are shared with a second thread (its hand-off costs ~50 us).
SPLIT_SCORES = 1 << 16
switch = PathSwitch()  # --cpu-prefill-attention
configure, enabled = switch.configure, switch.enabled
_pending = threading.local()  # softmaxes waiting for `evaluated_together` to evaluate their scores


def install() -> None:
    """Wraps mlx-lm's `PromptProcessingBatch.prompt` in `prefilling`, once per process."""
    original = PromptProcessingBatch.prompt
    if getattr(original, "prefill_attention", False):
        return

    @functools.wraps(original)
    def prompt(self: PromptProcessingBatch, tokens: list[list[int]]) -> None:
        with prefilling():
            return original(self, tokens)

    prompt.prefill_attention = True  # type: ignore[attr-defined]
    PromptProcessingBatch.prompt = prompt  # type: ignore[method-assign]


def claims(queries: mx.array, keys: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether `attention` computes this call: a prompt's attention on the CPU with a plain KV cache."""
    return switch.on and active() and computable(queries, keys, cache, mask, sinks)


def computable(queries: mx.array, keys: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether `attention` can compute this call: on the CPU, a plain (not quantized) KV cache, no sinks."""
    if sinks is not None or hasattr(cache, "bits"):
        return False
    if not isinstance(keys, mx.array) or queries.shape[1] % keys.shape[1]:
        return False
    if isinstance(mask, str) and mask != "causal" or not (mask is None or isinstance(mask, (str, mx.array))):
        return False
    if isinstance(mask, mx.array) and mask.ndim < 2:  # a rotating cache's window mask over the keys alone: MLX's
        return False
    return mx.default_device() == mx.cpu


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """softmax(q k^T * scale + mask) v for (batch, heads, queries, dim) against (batch, kv heads, keys, dim)."""
    batch, heads, length, dim = queries.shape
    key_length = keys.shape[2]
    rows = max(1, BLOCK_SCORES // max(1, batch * heads * key_length))
    parts = [_block(queries, keys, values, scale, mask, start, min(length, start + rows))
             for start in range(0, length, rows)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _block(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
           start: int, stop: int) -> mx.array:
    batch, heads, length, dim = queries.shape
    kv_heads, key_length = keys.shape[1], keys.shape[2]
    group, rows = heads // kv_heads, stop - start
    visible = key_length - length + stop if isinstance(mask, str) else key_length  # later keys: masked for all
    folded = (_float32(queries[:, :, start:stop]) * scale).reshape(batch, kv_heads, group * rows, dim)
    scores = folded @ _float32(keys[:, :, :visible]).swapaxes(-1, -2)
    # One query per sequence (a fused step's decode rows): normalised in NumPy, where it is a few thousand
    # sums; a column of ones beside a decode batch's values would copy its whole cache in every layer.
    normalise = rows == 1
    block_mask = mask if not isinstance(mask, mx.array) or mask.shape[-2] == 1 else mask[..., start:stop, :]
    softmax = functools.partial(_softmax_in_place, scores, (batch, kv_heads, group, rows, visible), block_mask,
                                heads, normalise)
    pending = getattr(_pending, "softmaxes", None)
    if pending is None:
        mx.eval(scores)
        softmax()
    else:
        pending.append((scores, softmax))
    if normalise:
        out = scores @ _float32(values[:, :, :visible])
    else:
        ones = mx.ones((*values.shape[:2], visible, 1), dtype=mx.float32)
        weighted = scores @ mx.concatenate([_float32(values[:, :, :visible]), ones], axis=-1)
        # Every row that sees a key has a normaliser >= 1 (its largest score gives exp(0)); fully masked rows give 0.
        out = weighted[..., :dim] / mx.maximum(weighted[..., dim:], 1.0)
    return out.reshape(batch, heads, rows, dim).astype(queries.dtype)


def _softmax_in_place(scores: mx.array, layout: tuple[int, ...], mask: Any, heads: int, normalise: bool) -> None:
    """Turns the evaluated `scores` into softmax numerators (or, `normalise`, probabilities) in their own buffer.

    The buffer is the evaluated product's: fresh, contiguous and ours alone, and the product with the
    values reads it next. (Setting `shape` raises rather than silently copying.)
    """
    grid = np.asarray(scores)
    grid.shape = layout  # (batch, kv heads, group, rows, visible keys)
    rows, visible = layout[3], layout[4]
    if isinstance(mask, str):
        np.copyto(grid[..., visible - rows:], -np.inf, where=np.triu(np.ones((rows, rows), dtype=bool), k=1))
    elif mask is not None:
        _apply_mask(grid, mask, heads, layout[1])
    if layout[1] >= 2 and grid.size >= SPLIT_SCORES:  # the other core takes the second half of the heads
        in_two(_exponentiate, grid[:, :1], grid[:, 1:])
    else:
        _exponentiate(grid)
    if normalise:  # every row that sees a key sums to >= 1 (its largest score gives exp(0)); fully masked: 0
        grid /= np.maximum(grid.sum(axis=-1, keepdims=True), 1.0)


@contextlib.contextmanager
def evaluated_together() -> Iterator[None]:
    """Evaluates the scores of the attentions built inside in one go, on leaving, then their softmaxes.

    Why: each NumPy softmax needs its scores evaluated first, and each evaluation stops the
    forward pass while the rest of it is built in Python. A fused step (`fused_forward`)
    computes two attentions per layer, its decode rows' and its chunk's; one evaluation for
    both halves the stops. Nothing built inside may be evaluated before leaving: its scores
    are raw until then.
    """
    if getattr(_pending, "softmaxes", None) is not None:  # nested: the outer one evaluates
        yield
        return
    _pending.softmaxes = softmaxes = []
    try:
        yield
    finally:
        _pending.softmaxes = None
    if softmaxes:
        mx.eval([scores for scores, _ in softmaxes])
        for _, softmax in softmaxes:
            softmax()


def _exponentiate(grid: np.ndarray) -> None:
    """exp(score - row max) in place: softmax's numerators."""
    peak = grid.max(axis=-1, keepdims=True)
    peak[~np.isfinite(peak)] = 0.0  # a row with every key masked: all zeros, not NaN
    grid -= peak
    np.exp(grid, out=grid)


def _float32(array: mx.array) -> mx.array:
    return array if array.dtype == mx.float32 else array.astype(mx.float32)


def _apply_mask(grid: np.ndarray, mask: mx.array, heads: int, kv_heads: int) -> None:
    """Applies an array mask (bool: keep where True; float: added) to scores laid out (B, kv, group, Q, K)."""
    # NumPy has no bfloat16 (an MLA model's additive mask is its scores' dtype): it is added as float32 anyway.
    values = np.array(mask if mask.dtype in (mx.bool_, mx.float32) else mask.astype(mx.float32))
    while values.ndim < 4:  # (queries, keys) or (batch, heads, queries, keys), each axis maybe broadcast
        values = values[None]
    if values.shape[1] == heads:
        values = values.reshape(values.shape[0], kv_heads, heads // kv_heads, *values.shape[2:])
    else:
        values = values[:, :, None]  # one mask for every head
    if values.dtype == np.bool_:
        np.copyto(grid, -np.inf, where=~values)
    else:
        grid += values.astype(np.float32)
