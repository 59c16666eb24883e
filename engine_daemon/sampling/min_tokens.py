"""vLLM's `min_tokens`: no EOS before the request has generated that many tokens.

Stop strings still end a reply early, as in vLLM. A grammar outranks it: once the grammar allows
only EOS (its format is complete), EOS stays allowed, or no token at all would be left to sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


class MinTokens:
    """Logits processor (mlx-lm signature): EOS is -inf for the first `minimum` tokens, unless nothing else is left."""

    def __init__(self, eos_token_ids: Sequence[int], minimum: int):
        self.eos = sorted(set(int(token) for token in eos_token_ids))
        self.minimum = minimum
        self.calls = 0  # one call per generated token, the first one included

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.calls += 1
        if self.calls > self.minimum or not self.eos:
            return logits
        ids = mx.arange(logits.shape[-1])
        is_eos = mx.zeros(ids.shape, dtype=mx.bool_)
        for token in self.eos:
            is_eos = is_eos | (ids == token)
        others_left = mx.any(mx.logical_and(logits > -float("inf"), mx.logical_not(is_eos)), axis=-1, keepdims=True)
        return mx.where(mx.logical_and(is_eos, others_left), mx.array(-float("inf"), dtype=logits.dtype), logits)
