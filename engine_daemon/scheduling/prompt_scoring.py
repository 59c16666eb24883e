"""A prompt's own log probabilities (`prompt_logprobs`), computed in bounded slices before it generates.

Why a pass of its own: the batch's prefill keeps the logits of a prompt's last position only
(mlx-lm's generators compute the others and drop them), while evaluation harnesses score
prompts: lm-evaluation-harness's loglikelihood tasks send `/v1/completions` with `echo` and
`logprobs` and sum the logprobs of the prompt's continuation tokens. So a request that asks
is taken aside when it would join the batch: its prompt goes through the model here, a slice
of positions per scheduler step (as long as the streams' gap target allows, like a paced
prefill), each slice's logprobs sent at once as DELTAS items. The KV this builds is the
prefill the request needs anyway: when the prompt is through, the request joins the batch as
a paused one resumes (`Preempted`), its last token fed there for the first new token. So the
prompt is computed once, and a request with `max_tokens` 0 (scoring only) never joins.

A scored prompt's rows stay behind (`ScoredPrefixes`) and its KV goes to the prefix cache, so a
later prompt starting with the same tokens (the next choice of a multiple-choice question, the
next question after the same few-shot examples) is scored from where they part.

Beside running streams a slice rides in their decode pass (`SideSlice`), sharing its read of every
weight; where it cannot (a model `fusable` rejects, several adapters' batches), it is a pass of its
own between two steps; while a prompt is prefilled beside the streams, its chunks have the room and
no slice runs. Sizes: `SliceBudget`.

One job runs at a time, max-min fair between clients (`_head`); only the running one holds KV. Text models outside an
engine group only: a vision model's prompt is built by mlx-vlm, a group's by every rank in lockstep.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from engine_daemon.errors import RequestError, engine_failure
from engine_daemon.generation.side_slice import SideSlice
from engine_daemon.request.state import EngineRequest
from engine_daemon.scheduling.base import Event, error_event
from engine_daemon.scheduling.fair_slots import Preempted
from engine_daemon.scheduling.scored_prefixes import ScoredPrefixes
from engine_daemon.scheduling.scoring_budget import BETWEEN, IDLE, RIDING, SliceBudget
from engine_daemon.scheduling.scoring_job import PARAM, ScoringJob
from protocol import MsgType

log = logging.getLogger(__name__)

# Entries built a tick, counting each alternative (a token's text and bytes, ~3 us each on the CPU): a prompt
# reusing 30k scored positions with 20 alternatives each would otherwise build ~600k in one go, ~2 s between two
# of the streams' steps. About 12 ms a tick; lm-evaluation-harness's one alternative sends 2,048 entries a tick.
ENTRY_CALLS = 4096


def wants_scoring(request: EngineRequest) -> bool:
    """A request that asked for its prompt's logprobs and has not had them yet."""
    return request.params.get(PARAM) is not None and not request.prompt_scored


def check_scoring(request: EngineRequest, kind: str, grouped: bool) -> None:
    """Refuses prompt logprobs where this pass cannot compute them (see the module's docstring)."""
    if not wants_scoring(request):
        return
    if kind != "text" or request.body.get("media"):
        raise RequestError(400, "unsupported_parameter", "Prompt logprobs are computed for text models and text "
                           "prompts only", param=PARAM)
    if grouped:
        raise RequestError(400, "unsupported_parameter", "Prompt logprobs are not available in an engine group",
                           param=PARAM)


@dataclass
class PromptScoring:
    """Requests whose prompts are being scored, in arrival order; the head one gets a slice per step."""

    budget: SliceBudget = field(default_factory=SliceBudget)
    max_kv_size: int | None = None
    # The prefix cache's lookup and insert, by its key: a prompt reuses the KV of the longest prefix scored before
    # (its rows from `store`), and a scored prompt's KV is kept there for later prompts, scored or not. The lookup
    # never reads the disk tier nor waits for a read (`PrefixCache.fetch`, `wait=False`): a job starts between steps.
    fetch: Callable[[Hashable, list[int]], tuple[list[Any] | None, int]] | None = None
    remember: Callable[[Hashable, list[int], list[Any]], None] | None = None
    store: ScoredPrefixes = field(default_factory=ScoredPrefixes)
    jobs: deque[ScoringJob] = field(default_factory=deque)
    steps: int = 0  # batch steps seen (`stepped`): a riding slice's rows are read once the step after it returned
    read_seconds: float = 0.0  # reading a riding slice's rows, per position (the latest read)
    scored_tokens: int = 0  # for /stats
    reused_tokens: int = 0
    scored_requests: int = 0
    slices: int = 0
    riding_slices: int = 0
    _offered: tuple[ScoringJob, SideSlice] | None = None
    _started: Counter[str] = field(default_factory=Counter)  # jobs started per client (`_head`)

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add(self, request: EngineRequest, model: Any, tokenizer: Any, key: Hashable | None = None) -> None:
        self.jobs.append(ScoringJob(request, model, tokenizer, self.max_kv_size, key))

    def requests(self) -> list[EngineRequest]:
        return [job.request for job in self.jobs]

    def remove(self, gone: set[int]) -> None:
        """Drops the jobs of these requests (`id()`s: aborted or failed); their KV goes with them."""
        self.jobs = deque(job for job in self.jobs if id(job.request) not in gone)
        if not self.jobs:
            self._started.clear()

    def clear(self) -> None:
        self.jobs.clear()
        self._offered = None
        self._started.clear()

    def step_failed(self, error: Any) -> list[Event]:
        """The batch step a slice was offered to failed: that prompt fails too (its KV may hold the slice's
        positions, and the pass that failed was partly its own)."""
        offered, self._offered = self._offered, None
        if offered is None or not any(offered[0] is job for job in self.jobs):
            return []
        self.jobs = deque(job for job in self.jobs if job is not offered[0])
        return [error_event(offered[0].request, error)]

    def tick(self, decode_seconds: float | None, vocab_size: int, generator: Any = None,
             prefilling: bool = False) -> tuple[list[Event], list[EngineRequest]]:
        """The head job's rows ready and its next slice: its DELTAS item, and the requests whose prompts are now
        through (each with its KV on `preempted`, to join the batch as a paused request resumes).

        `decode_seconds`: the streams' decode step (None: nothing decodes). `generator`: the batch's
        (`GroupedGenerator`), whose next step a slice may ride in. `prefilling`: a prompt is being prefilled
        beside the streams: its chunks have the gap's room, so no slice goes in this step.
        """
        if not self.jobs:
            return [], []
        job = self._head()
        request = job.request
        try:
            if job.cache is None:
                self._reuse(job)
            most = max(1, ENTRY_CALLS // (job.top + 1))
            read = self._read(job, self.steps - 1 if decode_seconds is not None else self.steps)
            if not job.finished and job.unsent_rows <= most:  # a reused prefix's entries go out first
                self._next_slice(job, decode_seconds, vocab_size, generator, prefilling)
            started = time.perf_counter()
            entries = job.unsent(most)
            if read:  # reading rows that rode includes their entries: what they add to the streams' gap
                self.read_seconds += (time.perf_counter() - started) / read
            through = job.finished and not job.unsent_rows
            if through:
                self._keep(job)
        except Exception as exc:  # this request fails, never the batch beside it
            log.exception("rid=%s: scoring its prompt failed", request.rid)
            self.jobs.popleft()
            return [error_event(request, engine_failure(exc))], []
        events: list[Event] = [(request.peer, MsgType.DELTAS, {"rid": request.rid, "seq": request.seq, "text": "",
                                                                 PARAM: entries})] if entries else []
        if not through:
            return events, []
        self.jobs.popleft()
        if not self.jobs:
            self._started.clear()  # turns count while the queue holds prompts (`_head`)
        request.prompt_scored = True
        self.scored_requests += 1
        log.info("rid=%s prompt scored: %d tokens, %d reused", request.rid, len(job.tokens), job.reused)
        if job.done:  # a prompt of one token has no KV yet: it joins as any request does
            request.preempted = Preempted(job.cache, job.tokens[:job.done], job.tokens[job.done:])
        return events, [request]

    def _head(self) -> ScoringJob:
        """The job to work on: the one started, else the oldest of the client that started fewest since the queue
        was last empty (max-min fair, as decode slots are: `fair_slots`). One client's evaluation run of
        thousands of prompts does not hold another client's prompt until it ends."""
        head = self.jobs[0]
        if head.started:
            return head
        best = min(self.jobs, key=lambda job: self._started[job.request.client])  # the first of the fewest: oldest
        if best is not head:
            self.jobs.remove(best)
            self.jobs.appendleft(best)
        best.started = True
        self._started[best.request.client] += 1
        return best

    def stepped(self, seconds: float, decode_seconds: float | None) -> bool:
        """After a batch step of `seconds`: whether the slice offered for it rode there (that step's time is then
        not a decode step's, and says what the slice cost)."""
        self.steps += 1
        offered, self._offered = self._offered, None
        if offered is None:
            return False
        job, side = offered
        if side.logits is None or not any(job is queued for queued in self.jobs):
            return False
        side.step = self.steps
        job.rode(side)
        positions = len(side.inputs)
        log.debug("rid=%s prompt scoring slice rode a %.1f ms decode step: %d positions (at %d of %d)",
                  job.request.rid, seconds * 1000, positions, job.fed, len(job.tokens))
        self.scored_tokens += positions
        self.slices += 1
        self.riding_slices += 1
        decode = decode_seconds or 0.0
        self.budget.observe(RIDING, positions, max(seconds - decode, 0.1 * decode) + self.read_seconds * positions)
        return True

    def _read(self, job: ScoringJob, through_step: int) -> int:
        """Reads the rows of the job's slices that rode in steps up to `through_step`, timed per position for
        `SliceBudget` (the tick adds their entries' time); how many."""
        started, before = time.perf_counter(), job.done
        job.read_riding(through_step)
        read = job.done - before
        if read:
            self.read_seconds = (time.perf_counter() - started) / read
        return read

    def _next_slice(self, job: ScoringJob, decode_seconds: float | None, vocab_size: int, generator: Any,
                    prefilling: bool) -> None:
        """Offers the next slice to the decode step, or runs it in a pass of its own."""
        adapter = job.request.body.get("adapter")
        if decode_seconds is not None and prefilling:
            return
        if decode_seconds is not None and generator is not None and generator.can_ride(adapter):
            side = job.side_slice(self.budget.size(RIDING, decode_seconds, vocab_size), adapter)
            if side is not None:
                generator.offer_side(side)
                self._offered = (job, side)
            return
        if job.riding:  # its rows come first (a pass of its own would be read before them)
            return
        kind = IDLE if decode_seconds is None else BETWEEN
        started, before = time.perf_counter(), job.fed
        job.step(self.budget.size(kind, decode_seconds, vocab_size))
        fed, seconds = job.fed - before, time.perf_counter() - started
        log.debug("rid=%s prompt scoring slice %.1f ms: %d positions (at %d of %d)", job.request.rid, seconds * 1000,
                  fed, job.fed, len(job.tokens))
        self.budget.observe(kind, fed, seconds)
        self.scored_tokens += fed
        self.slices += 1

    def _reuse(self, job: ScoringJob) -> None:
        """Starts `job` after the longest prefix scored before whose KV the prefix cache still holds.

        Looked up when the job starts, not when it is queued: the choices of a multiple-choice question
        arrive together, and the first one's context is scored (and kept, `_keep`) before the next starts.
        """
        found = None if job.key is None or self.fetch is None else self.store.longest(job.key, job.tokens, job.top)
        if found is None:
            return
        prefix, shared = found
        # The prefix cache leaves the last token it is given to compute: at most `shared - 1` positions, each of
        # which has its row in `prefix` (the row of position i is the logprob of token i + 1).
        cache, cached = self.fetch(job.key, job.tokens[:shared])
        if cache is None or cached < 1:
            return
        job.resume(cache, cached, prefix)
        job.request.cached_tokens = cached
        self.reused_tokens += cached

    def _keep(self, job: ScoringJob) -> None:
        """A scored prompt's rows for later prompts (`ScoredPrefixes`), its KV in the prefix cache. A request
        that goes on generates from that KV, so the prefix cache gets a copy."""
        if job.key is None or not job.done:
            return
        if self.fetch is not None:  # rows are reused only with the KV of their prefix
            self.store.insert(job.scored())
        if self.remember is not None:
            kept = copy.deepcopy(job.cache) if job.request.max_tokens else job.cache
            self.remember(job.key, job.tokens[:job.done], kept)

    def stats(self) -> dict[str, Any]:
        return {"prompt_logprob_requests": self.scored_requests, "prompt_logprob_tokens": self.scored_tokens,
                "prompt_logprob_reused_tokens": self.reused_tokens,
                "prompt_logprob_riding_slices": self.riding_slices,
                "prompt_logprob_slices": self.slices, "prompt_logprob_queued": len(self.jobs)}
