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
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch


class _NeverMatches:
    """A stop-sequence matcher that never completes (for the pending prompt token)."""

    def advance(self, token: int) -> bool:
        return False


NEVER_MATCHES = _NeverMatches()


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
    batch.uids, batch.prompt_cache, batch.tokens, batch.samplers = [], [], [], []
    batch.logits_processors, batch.max_tokens, batch.stop_sequences = [], [], []
    return generation


def start_generating(batch: GenerationBatch, uid: int) -> None:
    """The row's pending prompt token was computed: from now on its outputs are generated tokens."""
    row = batch.uids.index(uid)
    batch._matchers[row] = batch.stop_sequences[row].matcher()
