"""The logits processor that holds one request to a grammar (llguidance), on any MLX backend.

Why not `llguidance.mlx`: it applies the mask with `mx.fast.metal_kernel`, which
only exists on Apple GPUs. Here llguidance fills a numpy bitmask (one bit per
token) on the CPU and plain MLX ops unpack it and put -inf on forbidden tokens,
so Metal, CUDA and the CPU backend share one code path.

mlx-lm calls a processor as `processor(tokens, logits)` once per generated token,
both in `BatchGenerator` and in `generate_step` (the serial `--kv-bits` path).
`tokens` is the request's context: on the first call the whole prompt (with a
prefix-cache hit too: the cached part is passed as `all_tokens`), then one more
sampled token per call. The processor therefore remembers how many tokens it
has seen and feeds the matcher whatever came after; it never assumes the prompt
length. It also keeps working when called after the grammar finished (the
batch computes one more step for a row that just sampled EOS).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from engine_daemon.errors import describe

log = logging.getLogger(__name__)

# Shifts that unpack one int32 word into its 32 bits. Plain numpy at import: an mx array made
# here would belong to the importing thread's stream, and this module is imported before the
# mlx thread starts.
_BIT_SHIFTS = np.arange(32, dtype=np.int32)


def unpack_bitmask(words: np.ndarray, width: int) -> mx.array:
    """llguidance's int32 bitmask (1, ceil(V/32)) as a (1, width) bool array; ids past V are False."""
    bits = (mx.array(words)[:, :, None] >> mx.array(_BIT_SHIFTS)) & 1
    bits = bits.reshape(words.shape[0], -1)
    have = bits.shape[-1]
    if have >= width:
        bits = bits[:, :width]
    else:  # the model's output layer is padded past the tokenizer: those ids are never allowed
        bits = mx.concatenate([bits, mx.zeros((bits.shape[0], width - have), dtype=bits.dtype)], axis=-1)
    return bits.astype(mx.bool_)


class GrammarConstraint:
    """mlx-lm logits processor: only tokens the grammar allows next keep their logit.

    `gate_tokens`: when the prompt ends inside a thinking block, the constraint
    waits until the model has generated this sequence (the think-end tokens) and
    applies from the next token on, so reasoning stays free and the answer is held.
    Once the grammar is complete only EOS remains allowed, so generation stops.
    If the matcher ever fails (a bug, or a token forced by another processor), the
    request is steered to EOS instead of failing the shared batch step.

    `call_marker`: the grammar is free text until this token starts a tool call (strict tools
    under tool_choice "auto", `auto_calls`). Before it an EOS ends the output only as it ends an
    unconstrained one (not with `ignore_eos`), and is not fed to the matcher: with `ignore_eos`
    the text goes on, as it would without the grammar.
    """

    # Start the step's forward pass before waiting for the previous token (see _process).
    # None: only on a GPU; on the CPU backend the forward pass and llguidance share the same
    # cores and the early dispatch measured slightly slower.
    overlap_forward: bool | None = None

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids: Sequence[int],
                 gate_tokens: Sequence[int] | None = None, description: str = "grammar",
                 call_marker: int | None = None):
        self.matcher = matcher
        self.description = description
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.bitmask = allocate_token_bitmask(1, vocab_size)
        self.gate = tuple(gate_tokens) if gate_tokens else None
        self.recent: list[int] = []  # the last tokens while gated, to spot the gate sequence
        self.seen: int | None = None  # len(tokens) at the last call
        self.failed = False
        self.consumed = 0  # tokens the matcher accepted (for tests and logs)
        self.call_marker = call_marker
        self.in_text = call_marker is not None  # free text before a call: an EOS there is no grammar's end
        overlap = type(self).overlap_forward
        self.overlap = mx.default_device().type == mx.gpu if overlap is None else overlap

    @property
    def active(self) -> bool:
        return self.gate is None

    @property
    def done(self) -> bool:
        """The grammar is complete (or failed): only EOS can follow."""
        return self.failed or self.matcher.is_stopped()

    def ends_output(self, token: int) -> bool:
        """Whether sampling `token` ends the output: an EOS the grammar allowed, so even with `ignore_eos`.

        Once the grammar is complete it allows only EOS; with `ignore_eos` the request used to go on
        sampling EOS, and every one came back as "<|im_end|>" text until `max_tokens`.
        """
        return self.active and not self.in_text and token in self.eos_token_ids

    @property
    def failure(self) -> str | None:
        """Why the output stopped following the grammar (None: it did not), for the client's error."""
        return f"the output stopped following its {self.description} after {self.consumed} tokens" \
            if self.failed else None

    def _observe(self, token: int) -> None:
        if self.gate is not None:
            self.recent = (self.recent + [token])[-len(self.gate):]
            if tuple(self.recent) == self.gate:
                self.gate, self.recent = None, []
            return
        if self.failed:
            return
        if self.in_text:
            if token in self.eos_token_ids:
                return
            self.in_text = token != self.call_marker
        if self.matcher.is_stopped():
            if token not in self.eos_token_ids:
                self._fail(f"token {token} sampled after the grammar completed")
            return
        if self.matcher.consume_token(token):
            self.consumed += 1
        else:
            self._fail(f"token {token} rejected: {self.matcher.get_error()}")

    def _fail(self, why: str) -> None:
        self.failed = True
        log.error("%s constraint failed after %d tokens (%s): forcing EOS", self.description, self.consumed, why)

    def _eos_only(self, logits: mx.array) -> mx.array:
        ids = mx.arange(logits.shape[-1])
        allowed = mx.zeros(ids.shape, dtype=mx.bool_)
        for token in self.eos_token_ids:
            allowed = allowed | (ids == token)
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            return self._process(tokens, logits)
        except Exception as exc:  # never fail the batch step: end this request instead
            if not self.failed:
                self._fail(f"{type(exc).__name__}: {describe(exc)}")
            return self._eos_only(logits)

    def _process(self, tokens: mx.array, logits: mx.array) -> mx.array:
        size = tokens.shape[0]
        if self.seen is None:
            new: list[Any] = []  # the first call sees the prompt: nothing sampled yet
        else:
            if self.overlap and self.active and not self.failed:
                # Start this step's forward pass now, so the GPU computes it while the CPU
                # waits for the previous token and computes the mask below.
                mx.async_eval(logits)
            if size > self.seen:
                new = tokens[self.seen:].tolist()
            else:  # a context that stopped growing (a window): one call is one new token
                new = tokens[-1:].tolist()
        self.seen = size
        for token in new:
            self._observe(int(token))
        if not self.active:
            return logits
        if self.failed:
            return self._eos_only(logits)
        fill_next_token_bitmask(self.matcher, self.bitmask)
        if self.matcher.is_error():
            self._fail(self.matcher.get_error())
            return self._eos_only(logits)
        allowed = unpack_bitmask(self.bitmask, logits.shape[-1])
        if logits.ndim == 1:
            allowed = allowed[0]
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))
