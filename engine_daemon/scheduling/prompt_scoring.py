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

One job runs at a time, in arrival order; only the running one holds KV. Text models outside an
engine group only: a vision model's prompt is built by mlx-vlm, a group's by every rank in lockstep.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine_daemon.cpu.prefill_scope import prefilling
from engine_daemon.errors import RequestError, engine_failure
from engine_daemon.output.tokens import describe_token
from engine_daemon.request.state import EngineRequest
from engine_daemon.scheduling.base import Event, error_event
from engine_daemon.scheduling.fair_slots import Preempted
from engine_daemon.scheduling.scored_prefixes import ScoredPrefix, ScoredPrefixes
from protocol import MsgType

log = logging.getLogger(__name__)

PARAM = "prompt_logprobs"  # the ADD param: how many alternatives each prompt token lists (0: its own only)
LOGIT_BYTES = 64 << 20  # float32 logits of one slice's positions: the slice's rows are capped by the vocabulary
MIN_SLICE = 16
FIRST_SLICE = 64  # while streams decode and nothing has been measured yet
# A slice runs between two batch steps: the streams' gap becomes a decode step plus the slice, kept at this
# share of what `--max-gap-ratio` leaves past the decode step. On the ~85M CPU bench model a slice's time
# varies +-40% at one size, and at 0.8 the worst gaps reached 3.05-3.36x (the prompt-scoring benchmark).
GAP_SHARE = 0.65


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
class ScoringJob:
    """One request's prompt on its way through the model: `done` positions are in `cache`, each with its row."""

    request: EngineRequest
    model: Any  # the model bound to the request's adapter (`AdapterManager.bind`)
    tokenizer: Any
    max_kv_size: int | None = None  # the generator's own cache layout (`--max-kv-size`): the KV joins its batch
    key: Hashable | None = None  # the prefix cache's key for this model and adapter (None: nothing reused or kept)
    cache: list[Any] | None = None
    done: int = 0
    reused: int = 0  # leading positions whose KV and rows came from an earlier prompt (`ScoredPrefixes`)
    emitted: int = 0  # entries sent so far, the first token's included
    # Row i: what the model gave `tokens[i + 1]` (its logprob, the `top` most likely tokens and theirs).
    chosen: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_values: list[list[float]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_tokens

    @property
    def top(self) -> int:
        return int(self.request.params.get(PARAM) or 0)

    @property
    def finished(self) -> bool:
        return self.done >= len(self.tokens) - 1  # the last token is fed in the batch: its logits are a new token's

    def resume(self, cache: list[Any], cached: int, prefix: ScoredPrefix) -> None:
        """Starts after `cached` positions whose KV is `cache` and whose rows `prefix` holds."""
        top = self.top
        self.cache, self.done, self.reused = cache, cached, cached
        self.chosen = prefix.chosen[:cached].tolist()
        self.top_ids = prefix.top_ids[:cached, :top].tolist()
        self.top_values = prefix.top_values[:cached, :top].tolist()

    def step(self, budget: int) -> list[dict[str, Any]]:
        """Feeds the next `budget` positions; the log probability entries not sent yet."""
        if self.cache is None:
            self.cache = make_prompt_cache(self.model, max_kv_size=self.max_kv_size)
        end = min(len(self.tokens) - 1, self.done + budget)
        if end > self.done:
            top = self.top
            chosen, ids, values = score_positions(self.model, self.cache, self.tokens[self.done:end],
                                                  self.tokens[self.done + 1:end + 1], top)
            self.chosen += chosen
            self.top_ids += ids if top else [[] for _ in chosen]
            self.top_values += values if top else [[] for _ in chosen]
            self.done = end
        return self._unsent()

    def scored(self) -> ScoredPrefix:
        """What this prompt's rows give a later prompt sharing its start (`ScoredPrefixes`)."""
        return ScoredPrefix.of(self.key, self.tokens, self.chosen, self.top_ids, self.top_values, self.top)

    def _unsent(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        if self.emitted == 0:
            entries.append(self._entry(self.tokens[0], None, None, None))  # nothing predicts the first token
            self.emitted = 1
        top = self.top
        for row in range(self.emitted - 1, self.done):
            entries.append(self._entry(self.tokens[row + 1], self.chosen[row], self.top_ids[row] if top else None,
                                       self.top_values[row] if top else None))
        self.emitted = self.done + 1
        return entries

    def _entry(self, token: int, logprob: float | None, ids: list[int] | None,
               values: list[float] | None) -> dict[str, Any]:
        """The chat logprobs entry shape (`logprob_entries`): None logprob and alternatives for the first token."""
        entry = self._describe(token, logprob)
        if ids is None or values is None:
            entry["top_logprobs"] = None if logprob is None else []
        else:
            pairs = sorted(zip(ids, values), key=lambda pair: -pair[1])
            entry["top_logprobs"] = [self._describe(i, v) for i, v in pairs]
        return entry

    def _describe(self, token: int, logprob: float | None) -> dict[str, Any]:
        return describe_token(self.tokenizer, token, logprob)


def score_positions(model: Any, cache: list[Any], inputs: list[int], targets: list[int],
                    top: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Feeds `inputs` after what `cache` holds; for each position, the log probability of `targets`' token
    there and the `top` most likely tokens with theirs. Computed as a prompt's prefill is (`prefilling`),
    so the KV left in `cache` is the one a batch prefill of the same tokens would hold."""
    with prefilling():
        logits = model(mx.array(inputs)[None], cache=cache)
    rows = logits[0, :len(targets)].astype(mx.float32)
    if mx.default_device() == mx.cpu:
        mx.eval(rows, [c.state for c in cache])
        return _numpy_logprobs(np.array(rows), targets, top)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
    arrays = [chosen]
    if top:
        ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        arrays += [ids, mx.take_along_axis(logprobs, ids, axis=-1)]
    mx.eval(*arrays, [c.state for c in cache])
    lists = [array.tolist() for array in arrays]
    return lists[0], (lists[1] if top else []), (lists[2] if top else [])


def _numpy_logprobs(logits: np.ndarray, targets: list[int],
                    top: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """`score_positions`' log-softmax on the CPU in NumPy: MLX's x86 build takes `exp` one element at a time
    (~12-16 ns; NumPy's vectorised one ~1 ns), and a slice has an `exp` per vocabulary entry per position:
    128 positions of a 32k vocabulary took 60 ms in MLX, 13 ms here (`prefill_attention` has the same reason)."""
    peak = logits.max(axis=1, keepdims=True)
    shifted = logits - peak
    np.exp(shifted, out=shifted)
    normaliser = np.log(shifted.sum(axis=1, keepdims=True)) + peak  # log of the sum of exp(logits)
    rows = np.arange(len(targets))
    chosen = (logits[rows, np.asarray(targets)] - normaliser[:, 0]).tolist()
    if not top:
        return chosen, [], []
    # The most likely: an argmax for one (lm-evaluation-harness asks for one), else the top of a partition taken
    # from the high end (partitioning the negated table at 0 took 5x as long: 340 against 70 ms for 524 rows).
    ids = np.argmax(logits, axis=1)[:, None] if top == 1 else np.argpartition(logits, -top, axis=1)[:, -top:]
    return chosen, ids.tolist(), (np.take_along_axis(logits, ids, axis=1) - normaliser).tolist()


@dataclass
class PromptScoring:
    """Requests whose prompts are being scored, in arrival order; the head one gets a slice per step."""

    max_gap_ratio: float = 3.0
    idle_tokens: int = 2048  # a slice while nothing decodes (--prefill-step-size), capped by `LOGIT_BYTES`
    max_kv_size: int | None = None
    # The prefix cache's lookup and insert, by its key: a prompt reuses the KV of the longest prefix scored before
    # (its rows from `store`), and a scored prompt's KV is kept there for later prompts, scored or not.
    fetch: Callable[[Hashable, list[int]], tuple[list[Any] | None, int]] | None = None
    remember: Callable[[Hashable, list[int], list[Any]], None] | None = None
    store: ScoredPrefixes = field(default_factory=ScoredPrefixes)
    jobs: deque[ScoringJob] = field(default_factory=deque)
    last_slice: tuple[int, float] | None = None  # (positions, seconds) of the latest slice
    scored_tokens: int = 0  # for /stats
    reused_tokens: int = 0
    scored_requests: int = 0
    slices: int = 0

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add(self, request: EngineRequest, model: Any, tokenizer: Any, key: Hashable | None = None) -> None:
        self.jobs.append(ScoringJob(request, model, tokenizer, self.max_kv_size, key))

    def requests(self) -> list[EngineRequest]:
        return [job.request for job in self.jobs]

    def remove(self, gone: set[int]) -> None:
        """Drops the jobs of these requests (`id()`s: aborted or failed); their KV goes with them."""
        self.jobs = deque(job for job in self.jobs if id(job.request) not in gone)

    def clear(self) -> None:
        self.jobs.clear()

    def budget(self, decode_seconds: float | None, vocab_size: int) -> int:
        """Positions for the next slice: as many as the streams' gap target leaves past a decode step.

        Scaled from the latest slice (positions times room over its seconds), not from a cost per token:
        a slice's fixed cost (a read of every weight, the step's Python) would make a per-token rate learnt
        on small slices overshoot on large ones and the reverse, and a position costs more the later it is
        in the prompt. At most twice the last slice: one fast slice on a noisy machine must not size the next.
        """
        rows = max(MIN_SLICE, LOGIT_BYTES // (4 * max(1, vocab_size)))
        if decode_seconds is None:
            return min(rows, self.idle_tokens)
        if self.last_slice is None:
            return min(rows, FIRST_SLICE)
        positions, seconds = self.last_slice
        room = GAP_SHARE * max(0.1, self.max_gap_ratio - 1.0) * decode_seconds
        return int(min(rows, 2 * positions, max(MIN_SLICE, positions * room / max(seconds, 1e-6))))

    def tick(self, decode_seconds: float | None, vocab_size: int) -> tuple[list[Event], list[EngineRequest]]:
        """One slice of the head job: its DELTAS item, and the requests whose prompts are now through
        (each with its KV on `preempted`, to join the batch as a paused request resumes)."""
        if not self.jobs:
            return [], []
        job = self.jobs[0]
        request = job.request
        try:
            if job.cache is None:
                self._reuse(job)
            started, before = time.perf_counter(), job.done
            entries = job.step(self.budget(decode_seconds, vocab_size))
        except Exception as exc:  # this request fails, never the batch beside it
            log.exception("rid=%s: scoring its prompt failed", request.rid)
            self.jobs.popleft()
            return [error_event(request, engine_failure(exc))], []
        fed, seconds = job.done - before, time.perf_counter() - started
        log.debug("rid=%s prompt scoring slice %.1f ms: %d positions (at %d of %d)", request.rid, seconds * 1000, fed,
                  job.done, len(job.tokens))
        if fed:
            self.last_slice = (fed, seconds)
        self.scored_tokens += fed
        self.slices += 1
        events: list[Event] = [(request.peer, MsgType.DELTAS, {"rid": request.rid, "seq": request.seq, "text": "",
                                                                 PARAM: entries})]
        if not job.finished:
            return events, []
        self.jobs.popleft()
        request.prompt_scored = True
        self.scored_requests += 1
        log.info("rid=%s prompt scored: %d tokens, %d reused", request.rid, len(job.tokens), job.reused)
        self._keep(job)
        if job.done:  # a prompt of one token has no KV yet: it joins as any request does
            request.preempted = Preempted(job.cache, job.tokens[:job.done], job.tokens[job.done:])
        return events, [request]

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
                "prompt_logprob_slices": self.slices, "prompt_logprob_queued": len(self.jobs)}
