"""BatchGenerator's interface over one batch per LoRA adapter, plus the speculative lane.

Why groups: a forward pass computes with one adapter (`AdapterManager`
switches them between passes), so requests with different adapters cannot share a
batch row set. Each adapter in use gets its own mlx-lm `BatchGenerator`, bound to
its adapter, and every engine step advances every group by one token.

Fairness: groups take turns within each step, never across steps, so no group
waits for another to drain: a request for adapter B admitted while fifty adapter-A
requests decode gets its first token in the next step, and from then on one
token per step like everyone else. The price is one forward pass per active
group per step instead of one for everyone; with a single adapter in use (or
none) that is exactly the plain batch. Prompt caches are keyed by adapter
(BatchScheduler._cache_key), so a prefix computed with one adapter never serves
another.

The speculative lane (`SpeculativeLane`) serves a request that would
run alone; when a second request arrives, the lane's request moves into its
adapter's group with its KV cache before the step runs.

Uids handed out here are this object's own; each maps to (group, the group
generator's uid) or to the lane.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from contextlib import nullcontext
from typing import Any

from mlx_lm.generate import StopSequences

from engine_daemon.generation.side_slice import SideSlice, rides, riding
from engine_daemon.generation.speculative import SpeculativeDecoder, SpeculativeLane
from engine_daemon.generation.stall_free import StallFreeBatchGenerator
from engine_daemon.lora.adapters import AdapterManager

log = logging.getLogger(__name__)

LANE = "<speculative lane>"  # the location of the lane's uid (never an adapter key: those are paths)


class GroupedGenerator:
    """What BatchScheduler drives for text models: insert / remove / next / close, like BatchGenerator."""

    def __init__(self, loaded: Any, config: Any, stream: Any, adapters: AdapterManager,
                 speculative: SpeculativeDecoder | None = None):
        self.loaded, self.config, self.stream, self.adapters = loaded, config, stream, adapters
        self.speculative = speculative
        self.draft = speculative.draft_for(loaded) if speculative is not None and not config.max_kv_size else None
        self._groups: dict[str | None, StallFreeBatchGenerator] = {}
        self._live: dict[str | None, set[int]] = {}
        self._where: dict[int, tuple[str | None, int]] = {}
        self._global: dict[tuple[str | None, int], int] = {}
        self._uids = itertools.count()
        self._prefill_step_size = config.prefill_step_size
        self._ending_chunk: int | None = None  # `StallFreeBatchGenerator.ending_chunk`, set each step
        self._layer_deadline: tuple[float, float] | None = None
        self.lane: SpeculativeLane | None = None
        self._side: SideSlice | None = None  # a scored prompt's slice for the next step's decode pass (`offer_side`)
        self.fused_steps = 0  # steps whose prefill chunk rode in the decode pass (StallFreeBatchGenerator)
        self.first_tokens_at_prefill_end = 0  # first tokens handed back by their prompt's last chunk (ditto)
        # The base group first, and closed last: BatchGenerator restores Metal's wired limit on close,
        # so the first one made must be the last one closed.
        self._group(None)

    # -- BatchGenerator's interface ------------------------------------------------------------
    @property
    def prefill_step_size(self) -> int:
        return self._prefill_step_size

    @prefill_step_size.setter
    def prefill_step_size(self, value: int) -> None:
        self._prefill_step_size = value
        for generator in self._groups.values():
            generator.prefill_step_size = value

    @property
    def ending_chunk(self) -> int | None:
        return self._ending_chunk

    @ending_chunk.setter
    def ending_chunk(self, value: int | None) -> None:
        self._ending_chunk = value
        for generator in self._groups.values():
            generator.ending_chunk = value

    @property
    def layer_deadline(self) -> tuple[float, float] | None:
        return self._layer_deadline

    @layer_deadline.setter
    def layer_deadline(self, value: tuple[float, float] | None) -> None:
        """(bound, decode step) seconds for a chunk's cut between layers (`LayerDeadline`), set each step.

        Only with one group stepping: each group's pass is its own step, and the bound is the whole step's.
        """
        self._layer_deadline = value
        live = [key for key in self._groups if self._live.get(key)]
        for key, generator in self._groups.items():
            generator.carry.deadline = value if self.lane is None and live == [key] else None

    def carry_counts(self) -> tuple[int, int]:
        """Chunks cut between layers and carries rolled back, over every group (`CarryKeeper`)."""
        return (sum(g.carry.cuts for g in self._groups.values()), sum(g.carry.rollbacks for g in self._groups.values()))

    def last_cut(self) -> tuple[int | None, float | None]:
        """Where the last step's chunk left its pass, and that step's prompt work in tokens (None: no fused step)."""
        for generator in self._groups.values():
            if generator.carry.last_work is not None:
                return generator.carry.last_cut_layer, generator.carry.last_work
        return None, None

    def insert(self, prompts: list[list[int]], max_tokens: list[int], caches: list[Any], all_tokens: list[list[int]],
               samplers: list[Any], logits_processors: list[list[Any]], stop_sequences: list[StopSequences],
               adapters: list[str | None] | None = None, speculative: list[bool] | None = None) -> list[int]:
        uids = []
        for i, prompt in enumerate(prompts):
            args = {"prompt": prompt, "max_tokens": max_tokens[i], "cache": caches[i], "all_tokens": all_tokens[i],
                    "sampler": samplers[i], "processors": logits_processors[i], "stop": stop_sequences[i]}
            adapter = adapters[i] if adapters else None
            uid = next(self._uids)
            if speculative and speculative[i] and self._lane_free():
                self.lane = SpeculativeLane(self.speculative, self.adapters.bind(self.loaded, adapter), self.draft,
                                            self.stream, uid, adapter, prefill_step_size=self._prefill_step_size,
                                            **args)
                self._where[uid] = (LANE, uid)
            else:
                self._place(uid, adapter, args)
            uids.append(uid)
        return uids

    def can_ride(self, adapter: str | None) -> bool:
        """Whether a slice of a prompt with this adapter can ride in the next step's decode pass (`SideSlice`):
        only that adapter's batch steps, no speculative lane, and its step would only decode."""
        live = [key for key in self._groups if self._live.get(key)]
        return self.lane is None and live == [adapter] and rides(self._groups[adapter])

    def offer_side(self, side: SideSlice) -> None:
        """Puts `side` in the next step's decode pass (`can_ride` must hold); `side.logits` is set once it did."""
        self._side = side

    def preemptible(self, uid: int) -> bool:
        """Whether `uid` can be paused and resumed from its KV: a batch's sequence, not the speculative lane's."""
        where = self._where.get(uid)
        return where is not None and where[0] != LANE

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        found: dict[int, Any] = {}
        by_group: dict[str | None, dict[int, int]] = {}  # group -> its uid -> ours
        for uid in uids:
            where = self._where.pop(uid, None)
            if where is None:
                continue
            if where[0] == LANE:
                lane, self.lane = self.lane, None
                found[uid] = lane.remove()
                continue
            del self._global[where]
            self._live[where[0]].discard(uid)
            by_group.setdefault(where[0], {})[where[1]] = uid
        for key, ours in by_group.items():
            removed = self._groups[key].remove(list(ours), return_prompt_caches=return_prompt_caches)
            found.update({ours[local_uid]: value for local_uid, value in removed.items()})
        return found if return_prompt_caches else {}

    def extract_cache(self, uids: list[int]) -> dict[int, Any]:
        """Copies of the KV (and tokens) of sequences still running; the lane's sequence is left out."""
        found: dict[int, Any] = {}
        by_group: dict[str | None, dict[int, int]] = {}
        for uid in uids:
            where = self._where.get(uid)
            if where is not None and where[0] != LANE:
                by_group.setdefault(where[0], {})[where[1]] = uid
        for key, ours in by_group.items():
            extracted = self._groups[key].extract_cache(list(ours))
            found.update({ours[local_uid]: value for local_uid, value in extracted.items()})
        return found

    def next(self) -> tuple[list[Any], list[Any]]:
        if self.lane is not None and any(self._live.values()):
            self._migrate()
        progress: list[Any] = []
        responses: list[Any] = []
        if self.lane is not None:
            lane_progress, lane_responses = self.lane.next()
            progress += lane_progress
            responses += lane_responses
            if any(r.finish_reason is not None for r in lane_responses):
                self._where.pop(self.lane.uid, None)
                self.lane = None
        try:
            self._step_groups(progress, responses)
        finally:
            self._side = None  # offered for this step only
        self._drop_idle_groups()
        return progress, responses

    def _step_groups(self, progress: list[Any], responses: list[Any]) -> None:
        """Every live adapter's batch one step (a slice offered to the step rides in its adapter's, `SideSlice`)."""
        for key, generator in list(self._groups.items()):
            if not self._live.get(key):
                continue
            fused_before, early_before = generator.fused_steps, generator.first_tokens_at_prefill_end
            side = self._side if self._side is not None and self._side.adapter == key and rides(generator) else None
            with riding(generator, side) if side is not None else nullcontext():
                group_progress, group_responses = generator.next()
            self.fused_steps += generator.fused_steps - fused_before
            self.first_tokens_at_prefill_end += generator.first_tokens_at_prefill_end - early_before
            progress += [dataclasses.replace(p, uid=self._global[(key, p.uid)]) for p in group_progress
                         if (key, p.uid) in self._global]
            for response in group_responses:
                uid = self._global.get((key, response.uid))
                if uid is None:
                    continue
                if response.finish_reason is not None:  # the generator dropped it
                    del self._global[(key, response.uid)]
                    del self._where[uid]
                    self._live[key].discard(uid)
                responses.append(dataclasses.replace(response, uid=uid))

    def prefilling_turn(self) -> bool:
        """Whether some group is prefilling a conversation's next turn (`StallFreeBatchGenerator.prefilling_turn`)."""
        return any(generator.prefilling_turn() for key, generator in self._groups.items() if self._live.get(key))

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        for key in reversed(list(self._groups)):
            self._groups.pop(key).close()

    # -- groups ----------------------------------------------------------------------------------
    def _group(self, adapter: str | None) -> StallFreeBatchGenerator:
        generator = self._groups.get(adapter)
        if generator is None:
            config = self.config
            generator = StallFreeBatchGenerator(
                self.adapters.bind(self.loaded, adapter), max_tokens=config.default_max_tokens,
                completion_batch_size=config.decode_concurrency, prefill_batch_size=config.prompt_concurrency,
                prefill_step_size=self._prefill_step_size, max_kv_size=config.max_kv_size, stream=self.stream,
                fuse=config.fused_prefill)
            generator.ending_chunk = self._ending_chunk
            self._groups[adapter] = generator
            self._live[adapter] = set()
        return generator

    def _place(self, uid: int, adapter: str | None, args: dict[str, Any]) -> None:
        """Queues a sequence in its adapter's batch (a new one, or one leaving the lane)."""
        (local_uid,) = self._group(adapter).insert(
            [args["prompt"]], max_tokens=[args["max_tokens"]], caches=[args["cache"]],
            all_tokens=[args["all_tokens"]], samplers=[args["sampler"]], logits_processors=[args["processors"]],
            stop_sequences=[args["stop"]])
        self._where[uid] = (adapter, local_uid)
        self._global[(adapter, local_uid)] = uid
        self._live[adapter].add(uid)

    def _drop_idle_groups(self) -> None:
        """An adapter's group goes once it has nothing left (the base group stays: see __init__)."""
        for key in [k for k in self._groups if k is not None and not self._live[k]]:
            self._groups.pop(key).close()
            del self._live[key]

    # -- the speculative lane --------------------------------------------------------------------
    def _lane_free(self) -> bool:
        """A new sequence may run speculatively: a draft is set and nothing else runs or waits."""
        return self.draft is not None and self.lane is None and not any(self._live.values())

    def _migrate(self) -> None:
        """Moves the lane's sequence into its adapter's batch, because someone else arrived."""
        lane, self.lane = self.lane, None
        log.debug("speculative uid %d continues in the batch: another request arrived", lane.uid)
        self._place(lane.uid, lane.adapter, lane.detach())
