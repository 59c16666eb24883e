"""Fair decode slots between clients (API keys): who gets a free slot, and who gives one back.

`next_pending`: a free slot goes to the waiting request of the client holding fewest slots, oldest
first, within `--max-slots-per-key`. Why pre-emption too: slots only
free when requests end, so one client's burst that took every slot first (an agent's `n`=16 twice)
kept every other client waiting until it finished. Now, when slots are full and a waiting client
holds at least two fewer than the heaviest one, that client's most recent request that has
generated `PREEMPT_MIN_TOKENS` tokens leaves the batch with its KV (`Preempted`) and waits in the
queue. Its sampler, logits processors, detokenizer and output parser stay on the request, so it
resumes where it stopped with the same output it would have had (greedy, or seeded).

It cannot thrash: after a pre-emption the waiting client holds one more and the heavy one one
fewer, so the heavy client's paused request never out-waits the other. Text models only, one
engine (an engine group's followers replay a plan that knows no pause), never the speculative lane.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import trim_prompt_cache

from engine_daemon.request.state import EngineRequest

log = logging.getLogger(__name__)

# A request runs at least this many tokens before it can be paused: fewer, and the pause costs more than it frees.
PREEMPT_MIN_TOKENS = 16


def next_pending(pending: Iterable[EngineRequest], running: dict[int, EngineRequest], ceiling: int,
                 must_wait: Callable[[EngineRequest], bool]) -> EngineRequest | None:
    """The next request to take a slot: of the client holding fewest slots, oldest first.

    Max-min fair between clients: one client's burst (`n`=16 three times) cannot keep another
    client's request out of the batch while slots free up; with a `ceiling` no client holds more.
    `must_wait` is asked in that order and only until one may start: it can cost milliseconds a
    request (`BatchScheduler._waits` looks for the prompt's prefix in memory and on disk).
    """
    held = Counter(request.client for request in running.values())
    allowed = [request for request in pending if not (ceiling and held[request.client] >= ceiling)]
    for request in sorted(allowed, key=lambda request: held[request.client]):  # stable: oldest first
        if not must_wait(request):
            return request
    return None


@dataclass
class Preempted:
    """What a paused request resumes from: KV of `context`, then `rest` (its last sampled token) to feed."""

    cache: list[Any]
    context: list[int]
    rest: list[int]


def choose_victim(running: dict[int, EngineRequest], pending: Iterable[EngineRequest], ceiling: int,
                  preemptible: Callable[[int], bool],
                  must_wait: Callable[[EngineRequest], bool] | None = None) -> int | None:
    """The uid of the request to pause so a waiting client gets a slot, or None when shares are fair.

    Only requests that may start count (`must_wait`, asked only once shares look unfair: it can cost
    milliseconds a request): a victim paused for one that must wait anyway took its slot back at once,
    was paused again, and the scheduler recursed until `RecursionError` failed every request in flight.
    """
    held = Counter(request.client for request in running.values())
    waiting = [held[request.client] for request in pending if not ceiling or held[request.client] < ceiling]
    if must_wait is not None and waiting and held and held.most_common(1)[0][1] >= min(waiting) + 2:
        pending = [request for request in pending if not must_wait(request)]
        waiting = [held[request.client] for request in pending if not ceiling or held[request.client] < ceiling]
    if not waiting or not held:
        return None
    heavy, most = held.most_common(1)[0]
    if most < min(waiting) + 2:
        return None
    # Logits processors that follow the output (a grammar, a thinking budget) saw a step the pause throws away.
    candidates = [uid for uid, request in running.items()
                  if request.client == heavy and request.generated >= PREEMPT_MIN_TOKENS
                  and request.finish_reason is None and not request.processors and preemptible(uid)]
    return max(candidates, default=None)  # the most recently admitted


def pause(generator: Any, uid: int, request: EngineRequest) -> None:
    """Takes `uid` out of the batch, its KV and tokens kept on `request.preempted` (`BatchScheduler._insert`)."""
    cache, tokens = generator.remove([uid], return_prompt_caches=True)[uid]
    tokens = [int(t) for t in tokens]
    offset = cache[0].offset  # the context its KV covers; the rest (its last sampled token) is fed on resume
    if offset >= len(tokens):  # everything was fed: the last token's logits are computed again
        trim_prompt_cache(cache, offset - len(tokens) + 1)
        offset = len(tokens) - 1
    request.preempted = Preempted(cache, tokens[:offset], tokens[offset:])
    rewind = getattr(request.sampler, "rewind", None)
    if rewind is not None and not rewind(len(tokens) - len(request.prompt_tokens)):
        request.sampler = None  # out of its history: it resumes on a fresh chain (a seed's promise, broken)
        log.warning("rid=%s: its seeded draws could not be wound back across the pause", request.rid)
    log.info("rid=%s paused after %d tokens: its client held more decode slots than a waiting one's",
             request.rid, request.generated)
