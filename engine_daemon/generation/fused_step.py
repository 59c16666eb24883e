"""One forward pass for a decode step and a prefill chunk together (stall-free batching).

Why: a decode step of a few streams reads every weight once to make a handful of
tokens, so its cost is mostly that read; a prefill chunk run after it reads every
weight again. Sarathi-Serve's answer is to put the decode tokens and the prefill
chunk in one forward pass: the running streams then pay only the chunk's per-token
compute on top of the pass they needed anyway, and the newcomer's chunks cost what
they would cost alone. That is what lets a prompt arrive while others stream
without stretching their inter-token gaps much *and* without slowing its own
first token much.

How: the decoder layers of the llama family (llama, qwen2, qwen3, mistral) are
`x + attn(norm(x))` then `h + mlp(norm(h))`. The attention needs each sequence's
own KV cache and mask, so it runs once for the decode rows (their batch cache)
and once for the chunk (its cache), exactly as the model's own forward would; the
MLP, which holds most of the weights, runs once over the decode rows and the chunk
stacked together. Every row sees the same operations as in two separate passes, so
greedy output is the same up to the float rounding of a larger matrix product.

Only models whose layers have exactly that shape, with full attention in every
layer and no pipeline split, are fused (`fusable`); anything else keeps the two passes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

FUSABLE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def network(model: Any) -> nn.Module:
    """The mlx-lm model under an adapter binding (`BoundModel`) or the model itself."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "model") else model


def fusable(model: Any) -> bool:
    """Whether `fused_forward` computes exactly what the model's own forward computes."""
    net = network(model)
    body = getattr(net, "model", None)
    if getattr(net, "model_type", None) not in FUSABLE_MODEL_TYPES or body is None:
        return False
    if getattr(body, "pipeline_size", 1) != 1 or getattr(body, "swa_idx", None) is not None:
        return False
    layers = getattr(body, "layers", None)
    if not layers or not all(hasattr(layer, part) for layer in layers for part in _LAYER_PARTS):
        return False
    if any(getattr(layer, "use_sliding", False) for layer in layers):
        return False
    return all(hasattr(body, part) for part in ("embed_tokens", "norm"))


def fused_forward(model: Any, decode_inputs: mx.array, decode_cache: list[Any],
                  chunk_inputs: mx.array, chunk_cache: list[Any]) -> mx.array:
    """Logits of the decode rows (B, 1, vocab); the chunk's KV lands in `chunk_cache`.

    `decode_inputs` is (B, 1), `chunk_inputs` is (1, C). Logits for the chunk are not
    computed: a prefill chunk only fills its cache (as mlx-lm's prompt loop does).
    """
    switch = getattr(model, "switch", None)
    if switch is not None:  # an adapter binding: its adapter must be active for this pass
        switch.activate(model.weights)
    net = network(model)
    body = net.model
    decode_h = body.embed_tokens(decode_inputs)
    chunk_h = body.embed_tokens(chunk_inputs)
    decode_mask = create_attention_mask(decode_h, decode_cache[0])
    chunk_mask = create_attention_mask(chunk_h, chunk_cache[0])
    rows, width = decode_h.shape[0], decode_h.shape[-1]
    chunk_len = chunk_h.shape[1]
    last = len(body.layers) - 1
    for index, (layer, decode_c, chunk_c) in enumerate(zip(body.layers, decode_cache, chunk_cache)):
        decode_h = decode_h + layer.self_attn(layer.input_layernorm(decode_h), decode_mask, decode_c)
        chunk_h = chunk_h + layer.self_attn(layer.input_layernorm(chunk_h), chunk_mask, chunk_c)
        if index == last:  # the chunk's KV is complete: its last MLP would feed nothing
            decode_h = decode_h + layer.mlp(layer.post_attention_layernorm(decode_h))
            break
        stacked = mx.concatenate([decode_h.reshape(rows, width), chunk_h.reshape(chunk_len, width)], axis=0)
        stacked = stacked + layer.mlp(layer.post_attention_layernorm(stacked))
        decode_h = stacked[:rows].reshape(rows, 1, width)
        chunk_h = stacked[rows:].reshape(1, chunk_len, width)
    out = body.norm(decode_h)
    if getattr(net, "args", None) is not None and getattr(net.args, "tie_word_embeddings", False):
        return body.embed_tokens.as_linear(out)
    if hasattr(net, "lm_head"):
        return net.lm_head(out)
    return body.embed_tokens.as_linear(out)
