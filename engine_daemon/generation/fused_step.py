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
own KV cache and mask, so its core (rope, cache update, softmax) runs once for the
decode rows (their batch cache) and once for the chunk (its cache), through the
model's own attention module; every projection (q, k, v, o) and the MLP, which hold
all of the layer's weights, run once over the decode rows and the chunk stacked
together (`_projected` hands the attention module the stacked projections' rows).
Every row sees the same operations as in two separate passes, so greedy output is
the same up to float rounding: of a larger matrix product, and on the CPU of the NumPy
softmax and SwiGLU that the whole pass takes (`prefill_scope`), its decode rows included.

Only models whose layers have exactly that shape, with full attention in every
layer and no pipeline split, are fused (`fusable`); anything else keeps the two passes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from engine_daemon.cpu.prefill_attention import evaluated_together
from engine_daemon.cpu.prefill_scope import prefilling
from engine_daemon.generation.layer_carry import LayerCarry, Leaving

FUSABLE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class _Rows:
    """Stands in for a projection inside the attention module: its output rows, computed beforehand."""

    def __init__(self, value: mx.array):
        self.value = value

    def __call__(self, _x: mx.array) -> mx.array:
        return self.value


class _Identity:
    """Stands in for the output projection: it runs once over every row after both attention cores."""

    def __call__(self, x: mx.array) -> mx.array:
        return x


def _attention_core(attn: nn.Module, projected: dict[str, mx.array], shape: tuple[int, int, int], mask: Any,
                    cache: Any) -> mx.array:
    """The attention module's own forward with its projections replaced by precomputed rows.

    Returns (B, L, heads * head_dim) before the output projection.
    """
    originals = {name: attn[name] for name in _PROJECTIONS}
    try:
        for name in ("q_proj", "k_proj", "v_proj"):
            attn[name] = _Rows(projected[name].reshape(*shape[:2], -1))
        attn["o_proj"] = _Identity()
        return attn(_Shape(shape), mask, cache)
    finally:
        for name, module in originals.items():
            attn[name] = module


class _Shape:
    """What the attention module reads from its input besides the projections: only `x.shape`."""

    def __init__(self, shape: tuple[int, int, int]):
        self.shape = shape


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
    if not all(name in layer.self_attn for layer in layers for name in _PROJECTIONS):
        return False  # `_attention_core` swaps these child modules
    return all(hasattr(body, part) for part in ("embed_tokens", "norm"))


def fused_forward(model: Any, decode_inputs: mx.array, decode_cache: list[Any],
                  chunk_inputs: mx.array, chunk_cache: list[Any], chunk_last_logits: bool = False) -> mx.array:
    """Logits of the decode rows (B, 1, vocab); the chunk's KV lands in `chunk_cache`.

    `decode_inputs` is (B, 1), `chunk_inputs` is (1, C). A chunk in the middle of its
    prompt only fills its cache (as mlx-lm's prompt loop does): no logits. A chunk that
    ends its prompt (`chunk_last_logits`) adds one row, B + 1, the logits of its last
    token, from which the prompt's first token is sampled (`joined_with_logits`).
    """
    return fused_forward_carried(model, decode_inputs, decode_cache, chunk_inputs, chunk_cache,
                                 chunk_last_logits)[0]


def fused_forward_carried(model: Any, decode_inputs: mx.array, decode_cache: list[Any], chunk_inputs: mx.array,
                          chunk_cache: list[Any], chunk_last_logits: bool = False, carry: LayerCarry | None = None,
                          leaving: Callable[[int], Leaving] | None = None,
                          chunk_tokens: list[int] | None = None,
                          chunk_all_logits: bool = False) -> tuple[mx.array, LayerCarry | None]:
    """`fused_forward` that takes in a carried chunk and may cut its own chunk between layers (`LayerCarry`).

    `chunk_all_logits`: the logits of every chunk row follow the decode rows' (B + C rows), for a prompt
    scored for its own logprobs (`SideSlice`); such a chunk is never cut.

    `carry`: rows of an earlier chunk that stopped before layer `carry.start`; they rejoin there,
    before this chunk's rows (they are the positions just before them). `leaving(index)`, asked
    before each layer from layer 1 on until rows leave, says which prompt rows leave the pass
    there (`Leaving`): this chunk's, or the carry's too once it went through a layer in this
    pass. They come back as the returned carry (`chunk_tokens`: the tokens this chunk's rows
    stand for). A chunk that ends its prompt is never cut: its last row's logits are needed now.
    """
    net = _activated(model)
    body = net.model
    decode_h = body.embed_tokens(decode_inputs)
    decode_mask = create_attention_mask(decode_h, decode_cache[0])
    rows, width = decode_h.shape[0], decode_h.shape[-1]
    chunk_h = body.embed_tokens(chunk_inputs).reshape(-1, width)
    stacked = mx.concatenate([decode_h.reshape(rows, width), chunk_h], axis=0)
    new_rows = chunk_h.shape[0]  # this chunk's rows: the last ones of `stacked` while they are in the pass
    carry_tokens = list(carry.tokens) if carry is not None else []
    masks: dict[tuple[int, int], Any] = {}
    cut: LayerCarry | None = None
    last = len(body.layers) - 1
    for index, (layer, decode_c, chunk_c) in enumerate(zip(body.layers, decode_cache, chunk_cache)):
        if carry is not None and index == carry.start:  # the carried rows rejoin, before this chunk's
            stacked = mx.concatenate([stacked[:rows], carry.hidden, stacked[rows:]], axis=0)
        what = Leaving.NOTHING
        if cut is None and leaving is not None and not (chunk_last_logits or chunk_all_logits) and index >= 1:
            what = leaving(index)
        if what:
            with_carry = what == Leaving.ALL and carry is not None and index > carry.start
            out = new_rows + (len(carry_tokens) if with_carry else 0)
            cut = LayerCarry(stacked[-out:], index, (carry_tokens if with_carry else []) + list(chunk_tokens or []))
            stacked = stacked[:-out]
        chunk_len = stacked.shape[0] - rows
        attn = layer.self_attn
        normed = layer.input_layernorm(stacked)
        projected = {name: getattr(attn, name)(normed) for name in ("q_proj", "k_proj", "v_proj")}
        decode_part = {name: value[:rows] for name, value in projected.items()}
        chunk_part = {name: value[rows:] for name, value in projected.items()}
        # Both attentions through NumPy on the CPU, their scores evaluated in one go (`evaluated_together`):
        # the chunk's as its own prefill's would be, and the decode rows' because this pass stops at every
        # layer for the chunk's anyway (MLX's decode attention, with its scalar `exp`, was ~10 ms of a ~90 ms
        # fused step on the ~85M bench model: that was a cost the streams paid only in steps with a chunk).
        with prefilling(), evaluated_together():
            decode_out = _attention_core(attn, decode_part, (rows, 1, width), decode_mask, decode_c)
            if chunk_len:
                chunk_mask = _chunk_mask(masks, chunk_len, chunk_c, width)
                chunk_out = _attention_core(attn, chunk_part, (1, chunk_len, width), chunk_mask, chunk_c)
        if index == last:  # the chunk's KV is complete: only its last row's output can still feed anything
            kept, outputs = stacked[:rows], decode_out.reshape(rows, -1)
            if chunk_last_logits:
                kept = mx.concatenate([kept, stacked[-1:]], axis=0)
                outputs = mx.concatenate([outputs, chunk_out.reshape(chunk_len, -1)[-1:]], axis=0)
            elif chunk_all_logits and chunk_len:
                kept = stacked
                outputs = mx.concatenate([outputs, chunk_out.reshape(chunk_len, -1)], axis=0)
            decode_h = kept + attn.o_proj(outputs)
            with prefilling() if chunk_all_logits else nullcontext():  # a scored chunk's rows: as in other layers
                decode_h = decode_h + layer.mlp(layer.post_attention_layernorm(decode_h))
            break
        mixed = decode_out.reshape(rows, -1)
        if chunk_len:
            mixed = mx.concatenate([mixed, chunk_out.reshape(chunk_len, -1)], axis=0)
        stacked = stacked + attn.o_proj(mixed)
        with prefilling():  # mostly the chunk's rows: its SwiGLU is computed as its own prefill's would be
            stacked = stacked + layer.mlp(layer.post_attention_layernorm(stacked))
    return _logits(net, body.norm(decode_h.reshape(decode_h.shape[0], 1, width))), cut


def _chunk_mask(masks: dict[tuple[int, int], Any], length: int, cache: Any, width: int) -> Any:
    """The chunk's attention mask at a layer, from the layer's own cache (a carry leaves the first layers ahead).

    Layers whose caches hold as many positions share one mask (`masks`, by rows and positions).
    """
    held = getattr(cache, "_idx", None)
    if held is None:
        held = getattr(cache, "offset", None)
    key = (length, held if isinstance(held, int) else -1)
    if key[1] < 0 or key not in masks:
        masks[key] = create_attention_mask(_Shape((1, length, width)), cache)
    return masks[key]


def prompt_end_logits(model: Any, chunk_inputs: mx.array, chunk_cache: list[Any]) -> mx.array:
    """The forward over a prompt's last chunk (1, C), its last token included: that token's logits (1, 1, vocab).

    mlx-lm's prompt loop computes no logits and leaves the last token to a pass of its
    own; this computes the chunk as that loop does (`prefilling`) and the output head for
    the one row that needs it, so the first token can be sampled in the same step.
    """
    net = _activated(model)
    with prefilling():
        hidden = net.model(chunk_inputs, cache=chunk_cache)
    return _logits(net, hidden[:, -1:, :])


def _activated(model: Any) -> nn.Module:
    """`network(model)`, with the adapter of an adapter binding (`BoundModel`) made active for the pass."""
    switch = getattr(model, "switch", None)
    if switch is not None:
        switch.activate(model.weights)
    return network(model)


def _logits(net: nn.Module, normed: mx.array) -> mx.array:
    """The output head of a llama-family model over final-normed hidden states."""
    if getattr(net, "args", None) is not None and getattr(net.args, "tie_word_embeddings", False):
        return net.model.embed_tokens.as_linear(normed)
    if hasattr(net, "lm_head"):
        return net.lm_head(normed)
    return net.model.embed_tokens.as_linear(normed)
