"""Per-request samplers and logits processors, so requests with different settings share a batch.

A seeded request gets its own PRNG key chain: its draws do not depend on which
other requests share the step, so a `seed` gives the same output alone or batched.
Unseeded requests with identical settings share one sampler object, which lets
mlx-lm's BatchGenerator sample them in one batched call.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    categorical_sampling,
    make_logits_processors,
    make_sampler,
)

log = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]


def _top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """mlx-lm's `apply_top_k`, where a `top_k` of the vocabulary or more keeps every token.

    Why: `apply_top_k` raises for such a `top_k` inside its `mx.compile`, and a raise there leaves
    `mx.random.state` a placeholder: every later draw of every request failed until a restart.
    """
    return logprobs if top_k >= logprobs.shape[-1] else apply_top_k(logprobs, top_k)


def recover_random_state() -> bool:
    """After a failed step: a new global PRNG key when a raise inside a compiled sampler left
    `mx.random.state` unusable (see `_top_k`); True when it had to. Seeded requests keep their own keys."""
    try:
        mx.eval(mx.random.state)
        return False
    except Exception:  # noqa: BLE001 - any failure to evaluate the key means it is the placeholder
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        log.warning("the global random state was left unusable by a failed step: reseeded")
        return True


def _filters(top_p: float, min_p: float, top_k: int) -> list[Callable[[mx.array], mx.array]]:
    """The same filter chain, in the same order, as mlx_lm.sample_utils.make_sampler."""
    chain = []
    if 0 < top_p < 1.0:
        chain.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        chain.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        chain.append(lambda x: _top_k(x, top_k))
    return chain


@functools.lru_cache(maxsize=256)
def shared_sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    """One sampler object per distinct setting: mlx-lm's `make_sampler` (its greedy sampler at 0), the
    filters from `_filters`."""
    if temperature == 0:
        return make_sampler(temp=0.0)
    chain = _filters(top_p, min_p, top_k)

    def sample(logprobs: mx.array) -> mx.array:
        logprobs = logprobs.astype(mx.float32)  # see `SeededSampler.__call__`
        for method in chain:
            logprobs = method(logprobs)
        return categorical_sampling(logprobs, temperature)

    return sample


def seeded_sampler(seed: int, temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    """A sampler that draws from its own key chain, one split per token."""
    if temperature == 0:
        return shared_sampler(0.0, 0.0, 0.0, 0)
    return SeededSampler(seed, temperature, _filters(top_p, min_p, top_k))


class SeededSampler:
    """One request's draws from its own key chain, one split per token, which can be wound back.

    Why wind back: the batch samples a step ahead of what it has returned, so a request paused
    for another client (`engine_daemon.scheduling.fair_slots`) has used one key more than it kept;
    resuming from `rewind(kept)` draws exactly what it would have without the pause.
    """

    HISTORY = 16  # keys kept to wind back through

    def __init__(self, seed: int, temperature: float, chain: list[Callable[[mx.array], mx.array]]):
        self.key = mx.random.key(seed)
        self.temperature = temperature
        self.chain = chain
        self.draws = 0
        self._before: deque[mx.array] = deque(maxlen=self.HISTORY)  # the key before each recent draw

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._before.append(self.key)
        self.key, draw = mx.random.split(self.key)
        self.draws += 1
        # float32: scaled by 1/temperature, float16 logits overflow to -inf past ~65504 (every token at a
        # temperature of 2e-5 with a log-probability below -1.3): a uniform draw past every mask.
        logprobs = logprobs.astype(mx.float32)
        for method in self.chain:
            logprobs = method(logprobs)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=draw)

    def rewind(self, draws: int) -> bool:
        """Back to the state after `draws` draws; False when that is further back than the history."""
        back = self.draws - draws
        if back < 0 or back > len(self._before):
            return False
        for _ in range(back):
            self.key = self._before.pop()
        self.draws = draws
        return True


def make_request_sampler(sampling: dict[str, Any]) -> Sampler:
    args = (float(sampling.get("temperature", 0.0)), float(sampling.get("top_p", 0.0) or 0.0),
            float(sampling.get("min_p", 0.0) or 0.0), int(sampling.get("top_k", 0) or 0))
    if sampling.get("seed") is not None:
        return seeded_sampler(int(sampling["seed"]), *args)
    return shared_sampler(*args)


# Presence/frequency penalties look back this many tokens (mlx-lm's window; OpenAI's is the whole text).
PENALTY_CONTEXT = 256


def make_request_processors(sampling: dict[str, Any]) -> list:
    penalty = sampling.get("repetition_penalty")
    # 1.0 is "no penalty": skip the processor rather than multiply every logit by one.
    return make_logits_processors(
        logit_bias=sampling.get("logit_bias"),
        repetition_penalty=penalty if penalty not in (None, 1.0) else None,
        presence_penalty=sampling.get("presence_penalty"), presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=sampling.get("frequency_penalty"), frequency_context_size=PENALTY_CONTEXT)
