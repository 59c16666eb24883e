"""Prefix sharing between requests that run at the same time.

Why: the prefix cache used to learn a prompt only when its request finished, so eight
clients sending one 1,500-token system prompt together prefilled it eight times, and an
agent's next turn, sent while another of its calls still decoded, found nothing. Two rules
fix both, without touching mlx-lm's generator:

- `PrefillSharing.publish`: the step a prompt's prefill ends, its KV (copied out of the
  batch by `extract_cache`) enters the prefix cache under the prompt's tokens, while the
  request goes on decoding.
- `PrefillSharing.should_wait`: a request whose prompt shares at least `MIN_SHARED_TOKENS`
  not-yet-cached tokens with a prompt still prefilling stays pending until that prefill
  ends, then takes the shared part from the cache and prefills only its own suffix. It
  waits for at most one prefill, never for a decode, so it cannot starve.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from engine_daemon.request.state import EngineRequest

log = logging.getLogger(__name__)

# Shorter shared runs are cheaper to prefill twice than to wait a step for.
MIN_SHARED_TOKENS = 256


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefillSharing:
    """Which running prompts are still prefilling, and what their prefill shares with newcomers."""

    def __init__(self) -> None:
        self.prefilled: set[int] = set()  # uids whose prompt is fully in their KV
        self.published = 0  # prompts that entered the prefix cache at the end of their prefill
        self.waits = 0  # requests that waited for another request's prefill instead of repeating it
        self._waiting: set[str] = set()  # rids counted in `waits` and not yet admitted

    def forget(self, uids: Iterable[int]) -> None:
        self.prefilled.difference_update(uids)

    def admitted(self, rid: str) -> None:
        self._waiting.discard(rid)

    def clear(self) -> None:
        self.prefilled.clear()
        self._waiting.clear()

    def should_wait(self, request: EngineRequest, running: dict[int, EngineRequest]) -> bool:
        """Whether `request` should let a prefill in flight compute the prefix it shares with it."""
        prompt = request.prompt_tokens
        if len(prompt) < MIN_SHARED_TOKENS or request.body.get("media"):
            return False
        adapter = request.body.get("adapter")
        for uid, other in running.items():
            if uid in self.prefilled or other.body.get("adapter") != adapter or other.body.get("media"):
                continue
            # What the other prompt will add to the cache beyond what it found there itself.
            if common_prefix(prompt, other.prompt_tokens) - other.cached_tokens >= MIN_SHARED_TOKENS:
                if request.rid not in self._waiting:
                    self._waiting.add(request.rid)
                    self.waits += 1
                    log.debug("rid=%s waits for rid=%s's prefill of their shared prefix", request.rid, other.rid)
                return True
        return False

    def publish(self, progress: Sequence[Any], running: dict[int, EngineRequest], generator: Any,
                insert: Any) -> None:
        """Puts the KV of every prompt whose prefill ended this step into the prefix cache (`insert`)."""
        ended = [p.uid for p in progress if p.end_of_prompt and p.uid in running and p.uid not in self.prefilled]
        if not ended:
            return
        self.prefilled.update(ended)
        extract = getattr(generator, "extract_cache", None)
        if extract is None:
            return
        # A prompt that was mostly a cache hit adds little: copying its whole KV again is not worth it.
        ended = [uid for uid in ended
                 if len(running[uid].prompt_tokens) - running[uid].cached_tokens >= MIN_SHARED_TOKENS]
        for uid, (cache, _tokens) in (extract(ended).items() if ended else ()):
            request = running[uid]
            prompt = request.prompt_tokens
            offset = getattr(cache[0], "offset", None) if cache else None
            # The whole prompt, or all but its last token when that token waits for the next decode step
            # (`deferred_generation`); anything else is not the prompt's KV (a rotating window, a vision cache).
            if offset not in (len(prompt), len(prompt) - 1):
                log.debug("rid=%s: prefill KV holds %s tokens, prompt %d: not shared", request.rid, offset,
                          len(prompt))
                continue
            insert(list(prompt[:offset]), cache, request.body.get("adapter"))
            self.published += 1

    def stats(self) -> dict[str, int]:
        return {"prefix_published_at_prefill": self.published, "prefix_waits_for_shared_prefill": self.waits}
