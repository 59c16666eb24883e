"""A follower rank's loop: wait for a wake, then apply rank 0's plans to its own generator.

Followers have no front-end socket, no tokenizer work, no admission and publish nothing:
each plan's ops (inserts with rank 0's prompt tokens, sampling and seed; removals) go to
this rank's generator in rank 0's order, then the same `generator.next()` runs, whose
collectives (TP all_sums, PP sends) meet rank 0's. Token checksums are compared when the
plan asks. Runs on the process's main thread, which owns this rank's MLX stream.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from typing import Any

import mlx.core as mx
import zmq
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import trim_prompt_cache

from engine_daemon.config import SchedulerConfig
from engine_daemon.generation.grouped import GroupedGenerator
from engine_daemon.group.checksum import TokenChecksum, mismatched_ranks
from engine_daemon.group.control import ControlClient
from engine_daemon.group.plan import AddOp, StepPlan
from engine_daemon.group.settings import GROUP_FAILED_EXIT, GroupSettings
from engine_daemon.group.wire import PlanChannel
from engine_daemon.lora.adapters import AdapterManager
from engine_daemon.models.manager import ModelManager
from engine_daemon.sampling.request_processors import build_processors
from engine_daemon.sampling.samplers import make_request_processors, make_request_sampler
from engine_daemon.sampling.thinking import prompt_in_thinking

log = logging.getLogger(__name__)

STOP_GRACE = 2.0


class FollowerLoop:
    def __init__(self, settings: GroupSettings, group: Any, config: SchedulerConfig):
        self.settings, self.group, self.config = settings, group, config
        self.models = ModelManager(trust_remote_code=config.trust_remote_code, names=config.names, group=group,
                                   group_mode=settings.mode)
        self.context = zmq.Context()
        self.control = ControlClient(self.context, settings.control, settings.rank, self._memory,
                                     digest=lambda: self.models.current.weights_digest if self.models.current else "",
                                     progress=lambda: (self.at_tick, self.in_step),
                                     older_fields=injected_older_heartbeats())
        self.stopping = threading.Event()
        self.checksum = TokenChecksum()
        self._local: dict[int, int] = {}  # rank 0's uid -> this generator's
        self._leader: dict[int, int] = {}  # and back
        self.generator: GroupedGenerator | None = None
        # This rank's prompt cache: its shard's KV under rank 0's entry ids (`PlannedPrefixCache` decides all).
        self.cache_entries: dict[int, tuple[list[int], list[Any]]] = {}
        self._finished: dict[int, tuple[list[int], list[Any]]] = {}  # rank 0's uid -> KV, until the next plan
        self.ticks = 0
        self.at_tick, self.in_step = -1, False  # the last plan taken, and whether it is being applied (heartbeats)
        self.prefill_delay = injected_prefill_delay()

    def request_stop(self) -> None:
        """SIGTERM: keep following until rank 0's stop plan (the whole group is stopping: exit 0 cleanly), or
        exit after STOP_GRACE s (only this rank is stopping: rank 0 then sees it gone and fails the group)."""
        log.info("rank %d: stop requested; waiting up to %.0f s for rank 0's stop plan", self.settings.rank,
                 STOP_GRACE)
        threading.Timer(STOP_GRACE, lambda: os._exit(0)).start()

    def _memory(self) -> tuple[int, int]:
        current = self.models.current
        return (current.weights_bytes if current else 0, mx.get_active_memory())

    def run(self) -> int:
        """0 after rank 0's clean stop; GROUP_FAILED_EXIT when the group failed."""
        self.control.start()
        config = self.config
        ref = self.models.names.resolve(config.default_model, default_model=config.default_model,
                                        roots=config.model_dirs, allow_download=False)
        loaded = self.models.ensure(ref)
        stream = mx.default_stream(mx.default_device())
        channel = PlanChannel(self.group, stream)
        adapters = AdapterManager(config.model_dirs, config.adapter_cache_size, None, config.default_model)
        self.generator = GroupedGenerator(loaded, config, stream, adapters, None)
        log.info("rank %d ready (%s shard of %s, %.1f MiB of weights): waiting for plans", self.settings.rank,
                 self.settings.mode, ref.id, loaded.weights_bytes / 2**20)
        try:
            while self.control.wait_wake(self.stopping):
                while True:
                    plan = StepPlan.decode(channel.exchange())
                    self.at_tick, self.in_step = plan.tick, True
                    self._apply(plan, channel)
                    self.in_step = False
                    if plan.stop:
                        log.info("rank 0 stopped the group: rank %d exits", self.settings.rank)
                        return 0
                    if plan.idle:
                        break
        except Exception:
            log.critical("rank %d: the group failed", self.settings.rank, exc_info=True)
            return GROUP_FAILED_EXIT
        finally:
            self.control.stop()
        return 0

    def _apply(self, plan: StepPlan, channel: PlanChannel) -> None:
        generator = self.generator
        for kind, op in plan.ops:
            if kind == "add":
                self._insert(op)
            elif kind == "store":
                uid, entry = op
                if uid not in self._finished:
                    raise RuntimeError(f"tick {plan.tick}: rank 0 cached request {uid}, which did not finish here")
                self.cache_entries[entry] = self._finished.pop(uid)
            elif kind == "evict":
                for entry in op:
                    self.cache_entries.pop(entry, None)
            else:
                local = [self._local.pop(uid) for uid in op if uid in self._local]
                for uid in local:
                    self._leader.pop(uid, None)
                if local:
                    generator.remove(local)
        self._finished.clear()  # rank 0 decided in this plan which finished requests' KV to keep
        if not plan.step:
            return
        generator.prefill_step_size = plan.prefill_step_size
        if self.prefill_delay and any(kind == "add" for kind, _ in plan.ops):
            log.warning("fault injection: rank %d's step %d (a prefill) sleeps %.1f s", self.settings.rank, plan.tick,
                        self.prefill_delay)
            time.sleep(self.prefill_delay)
        _, responses = generator.next()
        self.ticks += 1
        self.checksum.observe((self._leader[r.uid], int(r.token)) for r in responses if r.uid in self._leader)
        for response in responses:
            if response.finish_reason is not None and response.uid in self._leader:
                leader = self._leader.pop(response.uid)
                self._local.pop(leader, None)
                if response.prompt_cache:
                    self._finished[leader] = (list(response.all_tokens), response.prompt_cache)
        if plan.checksum:
            values = channel.agree(self.checksum.value)
            if mismatched_ranks(values):
                raise RuntimeError(f"token checksum mismatch at tick {plan.tick}: {values}")

    def _insert(self, op: AddOp) -> None:
        cache, prefix = None, []
        if op.entry >= 0:  # the prefix rank 0 reused, from this rank's copy of the same entry
            if op.entry not in self.cache_entries:
                raise RuntimeError(f"rank 0 reused prompt-cache entry {op.entry}, which this rank does not hold")
            tokens, held = self.cache_entries[op.entry]
            if len(tokens) != op.entry_len:
                raise RuntimeError(f"prompt-cache entry {op.entry}: {len(tokens)} tokens here, "
                                   f"{op.entry_len} on rank 0")
            cache, prefix = copy.deepcopy(held), tokens[:op.cached]
            if op.cached < len(tokens):
                trim_prompt_cache(cache, len(tokens) - op.cached)
        processors = make_request_processors(op.sampling)
        if op.processors is not None:  # the same grammar / thinking budget rank 0 built, fed the same tokens
            tokenizer = self.models.current.tokenizer
            processors += build_processors(tokenizer, op.processors,
                                           prompt_in_thinking(tokenizer, list(prefix) + op.prompt))
        (uid,) = self.generator.insert(
            [op.prompt], max_tokens=[op.max_tokens], caches=[cache], all_tokens=[prefix],
            samplers=[make_request_sampler(op.sampling)], logits_processors=[processors],
            stop_sequences=[StopSequences([[token] for token in op.eos])], adapters=[None], speculative=[False])
        self._local[op.uid] = uid
        self._leader[uid] = op.uid


def injected_prefill_delay() -> float:
    """Tests only (MLX_ENGINE_FAULT_INJECTION=1, MLX_ENGINE_DEBUG_GROUP_PREFILL_SECONDS): a follower's step that
    starts a prefill takes this much longer, as a long prompt chunk on a slow rank does."""
    if os.environ.get("MLX_ENGINE_FAULT_INJECTION") != "1":
        return 0.0
    return float(os.environ.get("MLX_ENGINE_DEBUG_GROUP_PREFILL_SECONDS") or 0.0)


def injected_older_heartbeats() -> int:
    """Tests only (MLX_ENGINE_FAULT_INJECTION=1, MLX_ENGINE_DEBUG_GROUP_HEARTBEAT_FIELDS=3|4): this follower's
    heartbeats carry only their first fields, as an engine from before the weights check sent them."""
    if os.environ.get("MLX_ENGINE_FAULT_INJECTION") != "1":
        return 0
    return int(os.environ.get("MLX_ENGINE_DEBUG_GROUP_HEARTBEAT_FIELDS") or 0)
