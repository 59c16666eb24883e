"""A prefilled prompt joins the running decode batch without a forward pass of its own.

When a prompt's prefill ends, mlx-lm's `PromptProcessingBatch.generate` builds a
`GenerationBatch` for it whose constructor runs one forward pass over the prompt's last
token (to sample its first token), and then the decode batch absorbs it. While others
stream, that pass reads every weight once more for one row: on a small model on CPU
~45 ms added to the step where the newcomer joins, the running streams' longest gap.

`deferred_generation` builds the same `GenerationBatch` but leaves the last prompt token
as its pending input: the next decode step of the whole batch computes that row with the
others (the weights are read once for all rows). The row's first output of that step is
the prompt token itself, not a generated one; `StallFreeBatchGenerator` drops it. Until
then the row's stop-sequence matcher is `NEVER_MATCHES` and its token count starts at -1,
so the prompt token neither ends the request nor counts against `max_tokens`;
`start_generating` gives the row its real matcher once that step is done. The newcomer's
first token arrives one decode step later than on mlx-lm's path, and the cache, tokens,
samplers and logits processors are exactly what mlx-lm's path gives.

`joined_with_logits` is the other way to skip that pass: when the prompt's last chunk,
its last token included, rode in a decode step's forward pass (`fused_forward` with
`chunk_last_logits`), that pass already computed the logits mlx-lm's constructor would
compute. The `GenerationBatch` is built on mlx-lm's path with those logits standing in
for the forward pass, so the first token is sampled as mlx-lm samples it (sampler,
logits processors, token context). `first_token_now` then hands that token back at
once, in the step where the prefill ended, instead of with the next step's tokens
(mlx-lm's pipeline returns a step's input tokens): the next decode step outputs it a
second time, which is dropped, so the row's matcher is `NEVER_MATCHES` and its count
one lower until then, and `start_generating` puts back the matcher that has seen it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch


class _NeverMatches:
    """A stop-sequence matcher that never completes (for the pending prompt token)."""

    def advance(self, token: int) -> bool:
        return False


NEVER_MATCHES = _NeverMatches()


def emptied(batch: PromptProcessingBatch) -> None:
    """Leaves `batch` with no sequences: every one of them went to a `GenerationBatch` (as mlx-lm's `generate` does)."""
    batch.uids, batch.prompt_cache, batch.tokens, batch.samplers = [], [], [], []
    batch.logits_processors, batch.max_tokens, batch.stop_sequences = [], [], []


def deferred_generation(batch: PromptProcessingBatch, tokens: list[list[int]]) -> GenerationBatch:
    """`batch.generate(tokens)` without the forward pass: each row's last token waits for the next decode step."""
    if any(len(t) > 1 for t in tokens):
        batch.prompt([t[:-1] for t in tokens])
    uids = list(batch.uids)
    # No uids while constructing: GenerationBatch.__init__ runs its first step only when it has some.
    generation = GenerationBatch(batch.model, [], mx.array([t[-1] for t in tokens]), batch.prompt_cache,
                                 batch.tokens, None, batch.fallback_sampler, None, batch.stop_sequences,
                                 batch.max_tokens)
    generation.uids = uids
    generation.samplers = batch.samplers
    generation.logits_processors = batch.logits_processors
    generation._next_logprobs = [mx.zeros((1,)) for _ in uids]  # the pending rows' output is dropped
    generation._num_tokens = [-1] * len(uids)  # the pending prompt token must not count as generated
    generation._matchers = [NEVER_MATCHES] * len(uids)
    emptied(batch)
    return generation


def start_generating(batch: GenerationBatch, uid: int, matcher: Any = None) -> None:
    """The row's pending output was dropped: from now on its outputs are generated tokens.

    `matcher`: the stop-sequence matcher to go on with (one that has seen the first token,
    `first_token_now`); a fresh one after a deferred join's prompt token.
    """
    row = batch.uids.index(uid)
    batch._matchers[row] = matcher if matcher is not None else batch.stop_sequences[row].matcher()


def first_token_now(generation: GenerationBatch) -> tuple[GenerationBatch.Response, Any]:
    """The first token of a one-row batch fresh from `joined_with_logits`, as `GenerationBatch.next` would give it.

    Returns the response and, when the row goes on, the matcher `start_generating` must
    restore once the next decode step's repeat of the token is dropped (None when the
    first token ends the request: the row must not join the decode batch then).
    """
    token_array, logprobs = generation._next_tokens, generation._next_logprobs[0]
    mx.eval(token_array, logprobs)
    token = int(token_array.item())
    generation._num_tokens[0] += 1
    finish = "length" if generation._num_tokens[0] >= generation.max_tokens[0] else None
    matcher = generation._matchers[0]
    if matcher.advance(token):
        finish = "stop"
    uid = generation.uids[0]
    if finish is not None:
        return GenerationBatch.Response(uid, token, logprobs, finish, generation.extract_cache(0),
                                        generation.tokens[0]), None
    generation._num_tokens[0] -= 1  # the repeat counts it again
    generation._matchers[0] = NEVER_MATCHES
    return GenerationBatch.Response(uid, token, logprobs, None, None, None), matcher


class _ComputedLogits:
    """Stands in for the model in a `GenerationBatch`'s first step: logits a fused pass already computed."""

    def __init__(self, logits: mx.array):
        self.logits = logits

    def __call__(self, _inputs: mx.array, cache: object = None) -> mx.array:
        return self.logits


def joined_with_logits(batch: PromptProcessingBatch, last_tokens: list[int], logits: mx.array) -> GenerationBatch:
    """`batch.generate` for prompts whose KV holds every prompt token, the last one's `logits` (B, 1, vocab) known.

    The caller has recorded every token but the last in `batch.tokens`, as mlx-lm's
    `generate` has by then; the first step appends the last one, as it would.
    """
    generation = GenerationBatch(_ComputedLogits(logits), batch.uids, mx.array(last_tokens), batch.prompt_cache,
                                 batch.tokens, batch.samplers, batch.fallback_sampler, batch.logits_processors,
                                 batch.stop_sequences, batch.max_tokens)
    generation.model = batch.model
    emptied(batch)
    return generation
