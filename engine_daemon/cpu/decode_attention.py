"""Decode steps' attention on the CPU at long contexts, through `prefill_attention`'s NumPy softmax.

Why: a decode step scores every cached key with each sequence's one new query, and MLX's CPU
attention (`mx.fast.scaled_dot_product_attention` falls back to matmul, mask, softmax, matmul)
broadcasts the keys over the query heads that share them and takes `exp` one element at a
time. Per layer, 5 sequences of 3,000 tokens with 14 query heads over 2 key/value heads: 18 ms
in float32 and 32 ms in bfloat16 against 3.8 and 6.3 through `prefill_attention.attention`
(the shared heads folded into one product, SIMD `exp`). That path needs each layer's scores
evaluated before NumPy reads them, a stop that costs a decode step its asynchronous evaluation
(MLX builds the next step while this one runs); `prefill_scope` kept decode steps off it for
that reason. Measured on whole decode steps (real model, a batch cache, the next step built
while this one is evaluated, the two paths alternated): the ~85M bench model's step 174 -> 109 ms
at 5 x 2,000 tokens, 101 -> 73 ms at one 8,000-token sequence, the 0.5B model's 333 -> 287 ms at
4 x 1,000; at 8 x 100 tokens (8,000 scores a layer) within the noise either way. So a decode
step's attention takes this path once a layer's scores reach `MIN_SCORES`, and keeps MLX's
below. Results equal MLX's to float rounding (~1e-7 in float32), as the prefill path's do.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine_daemon.cpu.prefill_attention import computable
from engine_daemon.cpu.prefill_scope import PathSwitch, active

# Scores (sequences x query heads x queries x keys) a layer's decode attention needs before the NumPy path pays.
MIN_SCORES = 1 << 14
switch = PathSwitch()  # --cpu-decode-attention
configure, enabled = switch.configure, switch.enabled
_layers = 0  # layers' decode attention this path took since the engine started (`taken`)


def taken() -> int:
    """Layers whose decode attention took this path since the engine started (/stats `cpu_decode_attention_layers`).

    Why: the path only pays at long contexts, so whether a deployment's decode steps ever reach it (and a test
    that the daemon really takes it) is read from this count, not guessed from step times.
    """
    return _layers


def claims(queries: mx.array, keys: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether a decode step's attention (not a prompt's: `prefill_attention.claims`) takes the NumPy path."""
    global _layers
    if not switch.on or active() or not isinstance(keys, mx.array):
        return False
    batch, heads, length, _ = queries.shape
    # One query per sequence: a speculative step's several (verifying drafts) would copy the values with a column of
    # ones in every layer (`prefill_attention._block`), not measured against MLX's here.
    if length == 1 and batch * heads * keys.shape[2] >= MIN_SCORES and computable(queries, keys, cache, mask, sinks):
        _layers += 1
        return True
    return False
