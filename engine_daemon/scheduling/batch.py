"""Continuous batching on mlx-lm's BatchGenerator, with a prefix cache in front of it.

Requests join the running batch between steps and leave it the step they finish or are
aborted. Each request brings its own sampler and logits processors, so different sampling
settings share a batch. While others decode, prompts are prefilled in small chunks
(`interleave_prefill_tokens`) so a long prompt never stalls running streams for its whole prefill.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Any

from mlx_lm.generate import BatchGenerator, StopSequences

from engine_daemon.config import SchedulerConfig
from engine_daemon.cpu import prefill_attention
from engine_daemon.errors import RequestError, engine_failure
from engine_daemon.generation import vision_batch
from engine_daemon.generation.grouped import GroupedGenerator
from engine_daemon.generation.speculative import SpeculativeDecoder
from engine_daemon.generation.speculative import eligible as speculative_eligible
from engine_daemon.group.lockstep import GroupFailed, Lockstep, agree_seed, check_replayable
from engine_daemon.models.manager import ModelManager
from engine_daemon.models.store import ModelRef
from engine_daemon.models.vision_support import cache_stats as vision_cache_stats
from engine_daemon.multimodal import inputs as vision
from engine_daemon.prefix_cache.disk import DiskTier
from engine_daemon.prefix_cache.tiered import PrefixCache, layout_key
from engine_daemon.request.state import EngineRequest
from engine_daemon.sampling.samplers import make_request_processors, make_request_sampler, recover_random_state
from engine_daemon.scheduling import coalesce, fair_slots
from engine_daemon.scheduling.base import BaseScheduler, Event, error_event
from engine_daemon.scheduling.model_switch import ModelSwitchAdmission
from engine_daemon.scheduling.prefill_pacer import ROW_TILE, PrefillPacer, StepPeriods
from engine_daemon.scheduling.prefix_sharing import PrefillSharing
from engine_daemon.scheduling.prompt_progress import PromptProgress
from engine_daemon.scheduling.prompt_scoring import PromptScoring, check_scoring, wants_scoring
from engine_daemon.scheduling.scoring_budget import SliceBudget

log = logging.getLogger(__name__)


class BatchScheduler(ModelSwitchAdmission, BaseScheduler):
    batching = True
    batching_note = "continuous batching"

    def __init__(self, models: ModelManager, config: SchedulerConfig, stream: Any = None):
        super().__init__(models, config, stream)
        self.generator: BatchGenerator | None = None
        self.generator_ref: ModelRef | None = None
        self.by_uid: dict[int, EngineRequest] = {}
        self.uid_of: dict[str, int] = {}
        directory = config.prompt_cache_dir  # --prompt-cache-dir: prefixes outlive model switches and restarts
        self.disk_cache = DiskTier(directory, config.prompt_cache_disk_bytes) if directory else None
        self.prompt_cache = self._new_prefix_cache()
        # Accepted for the loaded model, waiting for a free slot (at most decode_concurrency run).
        self.pending: deque[EngineRequest] = deque()
        self.pacer = PrefillPacer(config.interleave_prefill_tokens or None, config.prefill_step_size,
                                  ratio=max(0.1, config.max_gap_ratio - 1.0), budget=config.step_token_budget or None,
                                  max_stall=config.max_stall_seconds or None, tile=ROW_TILE, spread=True,
                                  ttft_ratio=config.max_ttft_ratio or None,
                                  cuts=config.layer_cuts and prefill_attention.enabled())
        self.periods = StepPeriods()  # the pacer learns the gaps clients see, not the generator call alone
        self._prefill_progress = PromptProgress()
        # Prompts' KV shared while they run: published at the end of prefill, waited for (PrefillSharing).
        self.sharing = PrefillSharing()
        self._ended_prefills: list[Any] = []  # the last step's progress, shared in `after_publish`
        self.scoring = PromptScoring(SliceBudget(config.max_gap_ratio, config.prefill_step_size,
                                                 config.max_stall_seconds or None), config.max_kv_size,
                                     fetch=lambda key, tokens: self.prompt_cache.fetch(key, tokens, wait=False),
                                     remember=lambda key, tokens, cache: self.prompt_cache.insert(key, tokens, cache))
        self.speculative = (SpeculativeDecoder(config.draft_model, config.num_draft_tokens, config.trust_remote_code)
                            if config.draft_model else None)
        # Rank 0 of a group broadcasts each generator call (Lockstep; no prefill sharing there, GroupLeader.attach).
        self.lockstep: Lockstep | None = None

    # -- counts ---------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.by_uid) or bool(self.waiting) or bool(self.pending) or bool(self.scoring)

    def decoding(self) -> int:
        return sum(1 for request in self.by_uid.values() if request.seq > 0)

    def queued(self) -> int:
        return len(self.waiting) + len(self.pending) + len(self.scoring.jobs) + len(self.by_uid) - self.decoding()

    def running(self) -> int:
        return self.decoding()

    def all_requests(self) -> list[EngineRequest]:
        return self.queued_requests() + list(self.by_uid.values())

    def queued_requests(self) -> list[EngineRequest]:
        queued = [r for r, _ in self.waiting] + list(self.pending) + self.scoring.requests()
        return sorted(queued, key=lambda request: request.arrived)

    def unqueue(self, requests: list[EngineRequest]) -> None:
        super().unqueue(requests)
        gone = {id(request) for request in requests}
        self.pending = deque(other for other in self.pending if id(other) not in gone)
        self.scoring.remove(gone)
        for request in requests:
            self.sharing.admitted(request.rid)  # no longer waiting for anyone's prefill

    def worth_coalescing(self, window: float) -> bool:
        """A text prefill expected to take `COALESCE_FACTOR` windows or more (`worth_coalescing`)."""
        current = self.models.current
        if self.lockstep is not None or current is None or current.kind != "text":
            return False
        uncached = sum(len(r.prompt_tokens) - r.cached_tokens for r in self.by_uid.values())
        uncached += sum(len(r.prompt_tokens) for r in self.pending)
        speed = getattr(self.prompt_cache, "prefill_tokens_per_second", None)
        return coalesce.worth_coalescing(uncached, 1 / speed if speed else None, window)

    def prompt_cache_stats(self) -> dict[str, int]:
        vision_kv = getattr(self.generator, "prefix_cache_stats", dict)()  # VisionBatchGenerator's KV blocks
        return {**self.prompt_cache.stats(), **self.sharing.stats(), **vision_cache_stats(self.models.current),
                **vision_kv, **self.scoring.stats()}

    # -- admission ------------------------------------------------------------------
    def accept(self, request: EngineRequest) -> None:
        """Images/audio are checked against the model and built into inputs by `engine_daemon.multimodal.inputs`."""
        has_media = bool(request.body.get("media"))
        if has_media:
            vision.check_media_allowed(request.body, self.models.current)
            self.stats.media_inputs_on_mlx_thread += vision.prepare(request, self.models.current)  # a token prompt
        try:
            super().accept(request)
        except RequestError as exc:
            if has_media and exc.param == "prompt":
                exc.param = "messages"  # the client sent a chat, not a raw prompt
            raise
        if self.lockstep is not None:
            check_replayable(request)
        check_scoring(request, self.models.current.kind, self.lockstep is not None)

    def resolve_model(self, name: str | None, download: bool = True) -> ModelRef:
        """An engine group serves the one model it was started with: no switch (every rank would reload)."""
        ref = super().resolve_model(name, download)
        current = self.models.current
        if self.lockstep is not None and current is not None and ref != current.ref:
            raise RequestError(400, "unsupported_in_group", f"This engine group serves {current.ref.id} only; "
                               "it cannot switch models", param="model")
        return ref

    def _admit(self, request: EngineRequest) -> list[Event]:
        """Queues an accepted request; it enters the batch (and is ACCEPTED) when a slot frees."""
        self.pending.append(request)
        return self._fill_slots()

    def _next_pending(self) -> EngineRequest | None:
        """Of the client holding fewest slots, oldest first (`fair_slots.next_pending`), past those that wait."""
        if (best := fair_slots.next_pending(self.pending, self.by_uid, self.config.max_slots_per_key, self._waits)):
            self.pending.remove(best)
        return best

    def _waits(self, request: EngineRequest) -> bool:
        """A new text prompt waits while one in flight computes its prefix, or it is read from disk (`reading`)."""
        if self.models.current is None or self.models.current.kind != "text" or self.lockstep or request.preempted:
            return False
        key = self._cache_key(request.body.get("adapter"))
        return self.sharing.should_wait(request, self.by_uid) or (
            not wants_scoring(request) and self.prompt_cache.reading(key, request.prompt_tokens))

    def _fill_slots(self) -> list[Event]:
        events: list[Event] = []
        while self.pending and len(self.by_uid) < self.config.decode_concurrency:
            request = self._next_pending()
            if request is None:
                break  # every waiting client is at its --max-slots-per-key ceiling
            self.sharing.admitted(request.rid)
            resumed = request.preempted is not None or request.prompt_scored
            if wants_scoring(request):  # its prompt's logprobs first, then it joins with that KV (`PromptScoring`)
                current = self.models.current
                adapter = request.body.get("adapter")
                self.scoring.add(request, self.adapters.bind(current, adapter), current.tokenizer,
                                 self._cache_key(adapter))
                events.append(self.accepted_event(request))
                continue
            try:
                self._ensure_generator()
                self._insert(request)
            except Exception as exc:  # one bad request must never take the engine down
                log.exception("rid=%s could not join the batch", request.rid)
                events.append(error_event(request, engine_failure(exc)))
                continue
            if not resumed:
                events.append(self.accepted_event(request))
        if self.pending and len(self.by_uid) >= self.config.decode_concurrency and self._preempt():
            events += self._fill_slots()
        return events

    def _preempt(self) -> bool:
        """Pauses a request of the client holding most slots when a client holding 2+ fewer waits (`fair_slots`)."""
        generator = self.generator  # a GroupedGenerator: text models only (vision batches on mlx-vlm)
        if not (self.config.fair_preemption and self.lockstep is None and isinstance(generator, GroupedGenerator)):
            return False
        uid = fair_slots.choose_victim(self.by_uid, self.pending, self.config.max_slots_per_key, generator.preemptible,
                                       must_wait=self._waits)
        if uid is None:
            return False
        request = self.by_uid.pop(uid)
        del self.uid_of[request.rid]
        self._prefill_progress.forget(uid)
        self.sharing.forget((uid,))
        fair_slots.pause(generator, uid, request)
        self.pending.appendleft(request)
        self.stats.requests_preempted += 1
        return True

    def _new_prefix_cache(self) -> PrefixCache:
        return PrefixCache(self.config.prompt_cache_size, self.config.prompt_cache_bytes or 1 << 62, self.disk_cache,
                           model=lambda: self.models.current.model, max_kv_size=self.config.max_kv_size)

    def _cache_key(self, adapter: str | None = None) -> tuple[str, str | None]:
        """(the loaded weights' identity and KV layout, adapter key: `AdapterManager`): names do not matter."""
        return (layout_key(self.models.current.identity, self.config.max_kv_size), adapter)

    def _insert(self, request: EngineRequest) -> None:
        """Reuses the longest cached prefix of the prompt, then queues the rest for prefill."""
        prompt = request.prompt_tokens
        if self.models.current.kind != "text":  # vision models: `VisionBatchGenerator`
            uid = self.generator.insert_request(request)
            self.by_uid[uid] = request
            self.uid_of[request.rid] = uid
            self.stats.prompt_tokens += len(prompt)
            return
        adapter = request.body.get("adapter")  # the adapter key admission settled (BaseScheduler.accept)
        cache, cached, entry, entry_len = None, 0, -1, 0
        resume, request.preempted = request.preempted, None  # a paused request goes on from its own KV
        if resume is not None:
            cache, context, rest = resume.cache, resume.context, resume.rest
        elif self.lockstep is None:
            cache, cached = self.prompt_cache.fetch(self._cache_key(adapter), prompt)
        else:  # rank 0 decides the reuse for every rank (`PlannedPrefixCache`)
            request.sampling = agree_seed(request.sampling)  # every rank draws from the same key chain
            cache, cached, entry, entry_len = self.prompt_cache.fetch_planned(self._cache_key(adapter), prompt)
        if resume is None:
            rest, context, request.cached_tokens = prompt[cached:], prompt[:cached], cached
            self.stats.prompt_tokens += len(prompt)
            self.stats.prompt_cache_hits += bool(cached)
            self.stats.prompt_cache_misses += not cached
            self.stats.cached_tokens += cached
        request.sampler = request.sampler or make_request_sampler(request.sampling)
        eos = StopSequences([[token] for token in request.eos_token_ids])
        processors = make_request_processors(request.sampling) + request.processors
        (uid,) = self.generator.insert(
            [rest], max_tokens=[request.max_tokens - request.generated], caches=[cache], all_tokens=[context],
            samplers=[request.sampler], logits_processors=[processors], stop_sequences=[eos], adapters=[adapter],
            speculative=[resume is None and speculative_eligible(request.sampling, request.processors)])
        self.by_uid[uid] = request
        self.uid_of[request.rid] = uid
        if resume is not None:
            self.sharing.prefilled.add(uid)  # its prompt is in its KV already: nothing to share again
        if self.lockstep is not None:
            self.lockstep.added(uid, rest, request.max_tokens, request.sampling, list(request.eos_token_ids),
                                cached, entry, entry_len, request.processor_spec if request.processors else None)

    def _ensure_generator(self) -> None:
        current = self.models.current
        if self.generator is not None and self.generator_ref == current.ref:
            return
        self._close_generator()
        if current.kind != "text":  # vision models batch on mlx-vlm (`VisionBatchGenerator`)
            self.generator = vision_batch.make_generator(current, self.config, self.stream)
            self.generator_ref = current.ref
            return
        # One mlx-lm BatchGenerator per adapter in use, and the speculative lane (GroupedGenerator).
        self.generator = GroupedGenerator(current, self.config, self.stream, self.adapters, self.speculative)
        self.generator_ref = current.ref

    def _close_generator(self) -> None:
        if self.generator is not None:
            self.generator.close()
        self.generator, self.generator_ref = None, None
        recover_random_state()  # a failed step may have left the global key unusable (`samplers._top_k`)

    def reset(self) -> None:
        super().reset()
        self.pending.clear()
        self.scoring.clear()
        self.by_uid.clear()
        self.uid_of.clear()
        self._prefill_progress.clear()
        self.sharing.clear()
        self._ended_prefills = []

    def on_unload(self) -> None:
        self._close_generator()
        self.prompt_cache.spill_all()  # with --prompt-cache-dir, a switch back finds the prefixes on disk
        self.prompt_cache = self._new_prefix_cache()
        self.scoring.store.clear()

    def on_shutdown(self) -> None:
        """A clean stop: the hot prefixes go to disk for the next start (--prompt-cache-dir)."""
        self.prompt_cache.spill_all()

    # -- stepping -------------------------------------------------------------------
    def abort(self, rids: set[str]) -> int:
        queued = [request for request in self.queued_requests() if request.rid in rids]
        self.unqueue(queued)
        found = len(queued)
        uids = [self.uid_of.pop(rid) for rid in rids if rid in self.uid_of]
        for uid in uids:
            del self.by_uid[uid]
            self._prefill_progress.forget(uid)
        self.sharing.forget(uids)
        if uids:
            self.generator.remove(uids)
            if self.lockstep is not None:
                self.lockstep.removed(uids)
        found += len(uids)
        self.stats.requests_aborted += found
        return found

    def step(self) -> list[Event]:
        events = self._start_waiting() + self._fill_slots() + self._score_prompts()
        if not self.by_uid:
            if self.pending and not self.scoring:  # a prompt waits for its prefix's read: no busy loop meanwhile
                self.prompt_cache.reads.wait(0.05)
            return events
        generator = self.generator
        decoding = self.decoding()
        chunk = self.pacer.chunk(decoding, len(self.by_uid) - decoding)
        if not isinstance(generator, GroupedGenerator):  # vision: mlx-vlm's generator, unpaced when alone
            chunk = self.config.prefill_step_size if not decoding else max(chunk, self.pacer.minimum)
        elif decoding and not (self.pacer.fixed or self.pacer.budget) and generator.prefilling_turn():
            chunk = max(chunk, self.pacer.turn_chunk())  # a next turn goes in one step (`PrefillPacer.turn_chunk`)
        ending = None if self.lockstep else self.pacer.ending_chunk()  # a group's followers end prompts by chunk alone
        generator.prefill_step_size, generator.ending_chunk = chunk, ending
        if isinstance(generator, GroupedGenerator):  # a chunk's cut between layers goes by the clock: not in a group
            generator.layer_deadline = None if self.lockstep else self.pacer.step_deadline()
        if decoding and len(self.by_uid) > decoding and chunk:
            self.stats.prefill_chunk_tokens = generator.prefill_step_size
        fused_before = getattr(generator, "fused_steps", 0)
        early_before = getattr(generator, "first_tokens_at_prefill_end", 0)
        if self.lockstep is not None:
            self.lockstep.before_step(generator.prefill_step_size)  # a failed broadcast raises: the group fails
        started = time.perf_counter()
        try:
            progress, responses = generator.next()
            if self.lockstep is not None:
                self.lockstep.after_step((response.uid, int(response.token)) for response in responses)
        except GroupFailed:
            raise
        except Exception as exc:
            if self.lockstep is not None:
                raise GroupFailed(f"a group step failed: {exc}") from exc
            log.exception("batch step failed: failing %d request(s)", len(self.by_uid))
            error = engine_failure(exc)
            events += [error_event(request, error) for request in self.by_uid.values()]
            events += self.scoring.step_failed(error)  # the prompt whose slice rode in that step
            self.stats.requests_aborted += len(self.by_uid)
            self.by_uid.clear()
            self.uid_of.clear()
            self._prefill_progress.clear()
            self.sharing.clear()
            self._close_generator()
            return events
        ended = time.perf_counter()
        seconds, prompt_done = ended - started, self._prefill_progress.step_tokens(progress)
        early = getattr(generator, "first_tokens_at_prefill_end", 0) - early_before
        cut, work = generator.last_cut() if isinstance(generator, GroupedGenerator) else (None, None)
        period = self.periods.measure(started, ended)
        if not self.scoring.stepped(seconds, self.pacer.decode_seconds):  # a scored slice's step is no decode step
            self.pacer.observe(period, decoding, prompt_done if work is None else round(work),
                               prefilling=len(self.by_uid) - decoding, ended=early > 0)
        if isinstance(generator, GroupedGenerator):  # chunks cut between layers (`LayerCarry`)
            self.stats.prefill_layer_cuts, self.stats.prefill_carry_rollbacks = generator.carry_counts()
        fused = getattr(generator, "fused_steps", 0) - fused_before
        self.stats.fused_prefill_steps += fused
        self.stats.first_tokens_at_prefill_end += early
        if log.isEnabledFor(logging.DEBUG):  # the step trace behind inter-token gaps (`PrefillPacer`)
            log.debug("step %.1f ms: %d decoding, %d prompt tokens (chunk %d%s%s; prefill target %s)", seconds * 1000,
                      decoding, prompt_done, generator.prefill_step_size, ", fused" if fused else "",
                      "" if cut is None else f", cut at layer {cut}, {work:.0f} tokens' work",
                      self.pacer.describe_target())
        if not decoding:
            self.prompt_cache.observe_prefill(prompt_done, seconds)
        if self.models.current.kind == "text" and self.lockstep is None:
            self._ended_prefills = progress  # shared once this step's tokens are sent (`after_publish`)
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(responses))
        stopped_early: dict[int, str | None] = {}  # uid -> adapter key
        for response in responses:
            request = self.by_uid.get(response.uid)
            if request is None:
                continue
            events.append(self.token_event(request, int(response.token), response.logprobs))
            if request.finish_reason is None and response.finish_reason is not None:
                request.finish_reason = response.finish_reason  # the generator's own limit
            if request.finish_reason is None:
                continue
            del self.by_uid[response.uid]
            del self.uid_of[request.rid]
            self.sharing.forget((response.uid,))
            if response.finish_reason is not None:
                self._remember(response.all_tokens, response.prompt_cache, request.body.get("adapter"), response.uid)
            else:
                stopped_early[response.uid] = request.body.get("adapter")  # a stop string: still in the generator
        if stopped_early and self.lockstep is not None:
            generator.remove(list(stopped_early))
            self.lockstep.removed(stopped_early)
        elif stopped_early:
            for uid, tokens_cache in generator.remove(list(stopped_early), return_prompt_caches=True).items():
                cache, tokens = tokens_cache
                self._remember(tokens, cache, stopped_early[uid])
        return events

    def _score_prompts(self) -> list[Event]:
        """A slice of the head scored prompt (`PromptScoring`); one through joins the batch, or ends at max_tokens 0.
        Only while a slot is free: a prompt through holds its KV until it joins, so they must not pile up."""
        if not self.scoring or len(self.by_uid) >= self.config.decode_concurrency:
            return []
        decoding = self.decoding()
        decode_seconds = self.pacer.decode_seconds if decoding else None
        if decoding and decode_seconds is None:
            return []  # the streams' step is not measured yet: no room to size a slice by
        generator = self.generator if isinstance(self.generator, GroupedGenerator) else None
        events, through = self.scoring.tick(decode_seconds, self.models.current.vocab_size, generator,
                                            prefilling=len(self.by_uid) > decoding)
        for request in through:
            if request.max_tokens:
                self.pending.appendleft(request)
            else:
                events.append(self.token_event(request, None))
        return events + (self._fill_slots() if through else [])

    def after_publish(self) -> None:
        """Shares the KV of the prompts whose prefill ended in the last step (`PrefillSharing.publish`), once the
        step's tokens are sent: taking a prompt's KV out of the batch waits for the stream's queued work (after a
        join, the copy of the whole batch's KV), which made the step's tokens 8-20 ms late (~85M CPU model, a
        1,500-token prompt): a long-prompt trial's worst gap. The next step's admission still finds the prefix."""
        ended, self._ended_prefills = self._ended_prefills, []
        if ended and self.generator is not None:
            self.sharing.publish(ended, self.by_uid, self.generator, partial(self._remember, at_prefill=True))

    def _remember(self, tokens: list[int], cache: list[Any], adapter: str | None = None, uid: int = -1,
                  at_prefill: bool = False) -> None:
        """Keeps a finished request's KV for its next turn; `at_prefill`: a prompt's, shared while it runs."""
        if not tokens or not cache:
            return
        if self.lockstep is not None:  # followers keep their shard's KV of generator uid under the same id
            self.prompt_cache.insert_planned(self._cache_key(adapter), tokens, cache, uid)
            return
        self.prompt_cache.insert(self._cache_key(adapter), tokens, cache, at_prefill=at_prefill)
