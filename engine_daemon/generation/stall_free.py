"""mlx-lm's BatchGenerator with the decode step and the prefill chunk in one forward pass.

mlx-lm's `BatchGenerator._next` runs a decode step for the streams, then a chunk
of the prompts being prefilled, as two model calls. When exactly one prompt is
being prefilled and nothing else joins or leaves in that step (the common case:
a newcomer arrives while others stream), this generator makes the two one pass
(`fused_forward`): the decode batch's model call computes the chunk too, and the
prompt batch's own call for that chunk becomes a no-op. Everything else (which
chunk, the bookkeeping, sampling, when a prompt turns into a stream) stays
mlx-lm's, so the result is the same tokens at a lower cost. Every other step,
and every model `fusable` rejects, runs mlx-lm's path unchanged.

The chunk size is still `prefill_step_size`, set each step by the scheduler's
token budget (`PrefillPacer`). A fused step keeps mlx-lm's pipelining: the chunk's
KV is computed in the decode step's asynchronously evaluated graph, and the prompt
batch only records the chunk (`ChunkRecorded`). On the CPU, a chunk whose step runs past the
scheduler's bound leaves the pass between two layers and finishes in the next fused step
(`LayerCarry`); any other step rolls such a carry back first (`_settle_carry`).

The step where a prefilled prompt joins the running streams is the other place a
gap can open, so that step is made cheap too: the newcomer's KV is joined to the
batch's in one copy per tensor on two CPU streams (`cache_join`), and the prompt
never pays a forward pass of its own for its last token. mlx-lm holds that token
back for a pass of its own in the next step, whose sampled token the step after
hands back. Here, when the rest of a lone prompt fits the step's chunk, the last
token rides in that chunk (in the fused pass beside streams, in the chunk's own pass
when nothing decodes), its logits give the first token (`joined_with_logits`) and
that same step hands it back (`first_token_now`): two steps sooner. A conversation's
next turn (a short prompt after a long cached prefix) is then one step from its
arrival to its first token, not three. When the last chunk cannot be taken that way
(several prompts prefilled together), a prompt paced over several steps joins
deferred instead, its last token computed in the next decode step with the others
(`deferred_join`).
"""

from __future__ import annotations

import functools
import logging
import time
import types
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from engine_daemon.generation.cache_join import join_caches, joinable, own_kv
from engine_daemon.generation.deferred_join import (
    deferred_generation,
    emptied,
    first_token_now,
    joined_with_logits,
    start_generating,
)
from engine_daemon.generation.fused_stand_ins import ChunkRecorded, FusedDecode
from engine_daemon.generation.fused_step import fusable, network, prompt_end_logits
from engine_daemon.generation.join_reserve import JoinReserve
from engine_daemon.generation.layer_carry import CarryKeeper

log = logging.getLogger(__name__)

# A conversation's next turn: at least this many tokens cached, at most this many new (`_admission_limit`).
NEXT_TURN_CACHED = 256
NEXT_TURN_NEW = 256
# Rows a CPU matrix kernel computes at once (the pacer's `ROW_TILE`): a chunk shrunk for a carry keeps whole tiles.
CHUNK_TILE = 16


def _rest(segments: list[list[int]]) -> list[int]:
    """A prompt's tokens still to prefill, its held-back last token included."""
    return [token for segment in segments for token in segment]


def _split(batch: PromptProcessingBatch, indices: list[int]) -> PromptProcessingBatch:
    """`PromptProcessingBatch.split` without its deep copy of the KV when every prompt leaves.

    mlx-lm copies the whole prompt batch (every layer's KV) and then filters both halves;
    when all of it moves to generation, which is the usual case, that copy is a stall of
    its own (tens of ms for a 1,500-token prompt on a small model) in the step where the
    newcomer's first token is made. Handing the caches over is the same result.
    """
    if sorted(indices) != list(range(len(batch.uids))):
        return PromptProcessingBatch.split(batch, indices)
    moved = PromptProcessingBatch.__new__(PromptProcessingBatch)
    moved.__dict__.update(batch.__dict__)
    emptied(batch)
    return moved


def _materialized(extracted: dict[int, Any]) -> dict[int, Any]:
    """Extracted (cache, tokens) pairs with their KV copy started now.

    An extracted cache is a lazy slice of the batch's KV buffers. Held unevaluated (in the
    prefix cache, say), it keeps those buffers referenced, so the next decode step cannot
    write its new KV in place and copies every layer's whole batch buffer instead: a step
    ~60 ms longer on a small model right after a long prompt's KV is published. The copy
    of the one sequence's KV is started at once (`mx.async_eval`), ahead of the next step's
    work, but not waited for: on the 0.5B model a 1,500-token prompt's KV took 40-150 ms
    to copy, which the running streams' tokens of that step then waited for.
    """
    if extracted:
        mx.async_eval([[c.state for c in cache] for cache, _tokens in extracted.values()])
    return extracted


def _extend(batch: GenerationBatch, joining: GenerationBatch, reserve: JoinReserve | None = None) -> None:
    """`GenerationBatch.extend` with the KV joined by `join_caches` (one copy, two streams) when it can.

    mlx-lm's extend takes an empty cache list as "adopt the other's"; handing it the joined
    caches that way leaves every other field to mlx-lm.
    """
    if joinable(batch.prompt_cache, joining.prompt_cache):
        joining.prompt_cache = join_caches(batch.prompt_cache, joining.prompt_cache, reserve)
        batch.prompt_cache = []
    GenerationBatch.extend(batch, joining)


class StallFreeBatchGenerator(BatchGenerator):
    """A BatchGenerator whose prefill disturbs running streams as little as it can.

    It fuses a lone prompt's chunk into the decode step, joins finished prompts cheaply,
    prefills next turns one at a time and returns first tokens before others' prefill.
    """

    def __init__(self, model: Any, *args: Any, fuse: bool = True, defer_join: bool = True,
                 first_token_from_last_chunk: bool = True, **kwargs: Any):
        super().__init__(model, *args, **kwargs)
        self._prompt_batch.split = types.MethodType(self._split_prompts, self._prompt_batch)
        self.join_reserve = JoinReserve()  # the lone prompt's join buffers, made while it is prefilled beside streams
        self._generation_batch.extend = types.MethodType(functools.partial(_extend, reserve=self.join_reserve),
                                                         self._generation_batch)
        self.fuse = fuse and fusable(model)
        self.defer_join = defer_join
        self.fused_steps = self.deferred_joins = 0
        self.first_token_from_last_chunk = first_token_from_last_chunk
        self.ending_chunk: int | None = None  # the most tokens a step ending a prompt beside streams takes
        self.first_tokens_at_prefill_end = 0  # prompts whose first token came from their last chunk (`_step_ending`)
        # Rows whose next output is dropped (their own last prompt token, or a first token already handed back)
        # -> the stop-sequence matcher to go on with (`start_generating`; None: a fresh one).
        self._pending: dict[int, Any] = {}
        self._repeating: dict[int, Any] = {}  # first tokens handed back this step: pending from the next
        self._steps_beside_streams: dict[int, int] = {}  # prompt uid -> steps it spent prefilling while others decoded
        self._first_tokens_due: set[int] = set()  # joined last step: their first token is returned this step
        self.held_prefill_steps = 0
        self.prompt_concurrency = self.prefill_batch_size
        self._turns: set[int] = set()  # uids whose short prompt continues a long cached prefix (`_admission_limit`)
        self._ended: dict[int, list[Any]] = {}  # prompts that joined in the last step -> their own caches (`own_kv`)
        self.carry = CarryKeeper(len(network(model).model.layers) if self.fuse else 0)  # a chunk cut between layers
        self._step_started = 0.0

    def insert_segments(self, segments: Any, max_tokens: Any = None, caches: Any = None, all_tokens: Any = None,
                        *args: Any, **kwargs: Any) -> list[int]:
        uids = super().insert_segments(segments, max_tokens, caches, all_tokens, *args, **kwargs)
        for uid, parts, cached in zip(uids, segments, all_tokens or [[] for _ in uids]):
            if len(cached) >= NEXT_TURN_CACHED and sum(len(part) for part in parts) <= NEXT_TURN_NEW:
                self._turns.add(uid)
        return uids

    def _admission_limit(self) -> int:
        """How many prompts the prompt batch may hold this step (mlx-lm's `prefill_batch_size`).

        A conversation's next turn (a short prompt after a long cached prefix) is prefilled
        one at a time. Batching several copies each cached prefix into one left-padded cache
        and pads their new parts to the longest: on a small model three 40-token turns over
        ~1,300 cached tokens take longer together than one after another, and each waits for
        all of them before its first token. One at a time, the first answers after its own
        short prefill (`_hold_prefill` returns its first token before the next one's prefill).
        Other prompts batch up to `--prompt-concurrency` as before.
        """
        waiting = self._unprocessed_sequences
        if not waiting or waiting[0][0] not in self._turns:
            return self.prompt_concurrency
        turn_in_batch = any(uid in self._turns for uid in self._prompt_batch.uids)
        return len(self._prompt_batch) + (0 if turn_in_batch else 1)

    def prefilling_turn(self) -> bool:
        """Whether a conversation's next turn is being (or is next to be) prefilled (`_admission_limit`)."""
        waiting = self._unprocessed_sequences  # a deque: its head is the next to be admitted
        if waiting and waiting[0][0] in self._turns:
            return True
        return any(uid in self._turns for uid in self._prompt_batch.uids)

    def _split_prompts(self, batch: PromptProcessingBatch, indices: list[int]) -> PromptProcessingBatch:
        """`_split`; a long prompt joining running streams takes `deferred_generation` (no pass of its own).

        Only prompts that were prefilled over several steps beside running streams (paced
        prompts) join deferred: those streams are what the deferral protects. A short prompt
        (a chat's next turn, prefilled in one step) joins on mlx-lm's path and gets its first
        token one step sooner.
        """
        paced = max((self._steps_beside_streams.pop(batch.uids[i], 0) for i in indices), default=0)
        moved = _split(batch, indices)
        if self.defer_join and len(self._generation_batch) > 0 and paced >= 2:
            moved.generate = types.MethodType(self._generate_deferred, moved)
        return moved

    def _generate_deferred(self, batch: PromptProcessingBatch, tokens: list[list[int]]) -> GenerationBatch:
        generation = deferred_generation(batch, tokens)
        self._pending.update(dict.fromkeys(generation.uids))
        self.deferred_joins += len(generation.uids)
        return generation

    def _drop_pending_outputs(self, result: Any) -> Any:
        """Removes the outputs that were pending rows' own last prompt tokens (`deferred_generation`)."""
        if not self._pending or not result:
            return result
        prompt_responses, generation_responses = result
        kept = []
        for response in generation_responses:
            # A pending row cannot finish on its prompt token (no matcher, count from -1); should it
            # anyway, its response is passed on so the request still ends.
            if response.uid in self._pending and response.finish_reason is None:
                start_generating(self._generation_batch, response.uid, self._pending[response.uid])
            else:
                kept.append(response)
            self._pending.pop(response.uid, None)
        return prompt_responses, kept

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        if self.carry.uid in uids:
            self._settle_carry(keep=False)
        for uid in uids:
            self._pending.pop(uid, None)
            self._repeating.pop(uid, None)
            self._ended.pop(uid, None)  # a finished row's KV holds its generated tokens too: mlx-lm's extract
        self._first_tokens_due.difference_update(uids)  # a removed row holds no prefill back
        self._turns.difference_update(uids)
        self.join_reserve.forget(uids)
        for uid in uids:
            self._steps_beside_streams.pop(uid, None)
        return super().remove(uids, return_prompt_caches=return_prompt_caches)  # extracts via extract_cache

    def extract_cache(self, uids: Any) -> Any:
        """Copies of running rows' KV; a prompt that joined in the last step's from its own cache (`own_kv`).

        That copy is left lazy: started now (`_materialized`), it waited 10-24 ms behind the join's
        copy (MLX bounds the work in flight) between two of the running streams' tokens, and a slice
        of the prompt's own buffers holds up no in-place write of the batch's. Unless the batch took
        those buffers over (nothing else decoded): then it is started now, as any other row's.
        """
        batch = self._generation_batch
        started, lazy = {}, {}
        for uid in uids:
            kv = own_kv(self._ended[uid]) if uid in self._ended and uid in batch.uids else None
            if kv is not None:
                adopted = bool(batch.prompt_cache) and batch.prompt_cache[0] is self._ended[uid][0]
                (started if adopted else lazy)[uid] = (kv, batch.tokens[batch.uids.index(uid)])
        rest = [uid for uid in uids if uid not in started and uid not in lazy]
        return {**lazy, **_materialized({**started, **(super().extract_cache(rest) if rest else {})})}

    def _fusable_chunk(self) -> tuple[list[int], bool] | None:
        """The chunk this step will prefill when it can ride in the decode pass, and whether it ends the prompt."""
        if not self.fuse or self._admits() or len(self._currently_processing) != 1:
            return None  # a prompt joins the prompt batch this step, or several are prefilled
        generating = len(self._generation_batch)
        if generating == 0 or generating >= self.completion_batch_size:
            return None
        segments = self._currently_processing[0][0]
        if not segments:
            return None
        if self._ends_in_this_chunk(segments):
            return _rest(segments), True
        if len(segments) == 1 and len(segments[0]) == 1:
            return None  # the prompt turns into a stream this step on mlx-lm's path: nothing to prefill
        chunk = list(segments[0][: self.carry.shrunk(self.prefill_step_size, generating, CHUNK_TILE)])
        if self.carry.deadline is not None and len(segments) > 1 and 1 < len(chunk) == len(segments[0]):
            # It leaves a token to the step that ends the prompt: a chunk that ends its segment is never cut
            # (rolled back, its carry would merge with the last token's segment), and uncut such a step with a
            # carry took 1.6 s where the bound was 1.1 (0.5B CPU model).
            chunk = chunk[:-1]
        return (chunk, False) if chunk else None

    def _admits(self) -> bool:
        """Whether mlx-lm's `_next` will move a waiting prompt into the prompt batch during this step."""
        return bool(self._unprocessed_sequences) and self.prefill_batch_size > len(self._prompt_batch)

    def _ends_in_this_chunk(self, segments: list[list[int]]) -> bool:
        """Whether the rest of the prompt, its last token included, fits this step's chunk.

        mlx-lm keeps the last token as a segment of its own (`insert_segments`); the rest
        before it is one segment once earlier segments are done. Beside streams, that step also joins
        the prompt's KV to theirs (118-193 ms for 1,500 tokens on the 0.5B CPU model), so it takes at
        most `ending_chunk` tokens (`PrefillPacer.ending_chunk`): a longer rest is prefilled first.
        """
        if not self.first_token_from_last_chunk:
            return False
        if len(segments) == 1:
            return len(segments[0]) == 1
        ending = self.ending_chunk if self.ending_chunk is not None and len(self._generation_batch) else None
        limit = self.prefill_step_size if ending is None else min(self.prefill_step_size, ending)
        # A carry's remaining layers count against it too: that step is never cut, and a 58-row carry finished
        # beside the join made one 3.3x the streams' steady gap (~85M model). The carry then goes first.
        carried = self.carry.carry.remaining_fraction(self.carry.layers) if self.carry.carry is not None else 0.0
        return len(segments) == 2 and len(segments[1]) == 1 and len(segments[0]) + 1 + carried <= limit

    def _joining_this_step(self) -> list[int]:
        """Prompts whose prefill is done: they move to the decode batch in this step."""
        return [self._prompt_batch.uids[i] for i, seq in enumerate(self._currently_processing)
                if len(seq[0]) == 1 and len(seq[0][0]) == 1]

    def _hold_prefill(self, joining: list[int]) -> bool:
        """Whether this step should prefill nothing, so a first token is not held up by others' prompts.

        mlx-lm hands back a step's tokens only when the whole step is done, prefill included,
        and a prompt that joins the decode batch in step S returns its first token at the
        end of step S+1. When other prompts are still being prefilled (conversations' next
        turns landing together), those two steps would each carry their prefill, and the
        first prompt's first token would wait for all of it. Holding their prefill for those
        two steps returns it one short decode step after its own prefill; the others lose two
        decode steps.
        """
        others = [uid for uid in self._prompt_batch.uids if uid not in joining]
        if not others and not self._unprocessed_sequences:
            return False
        return bool(joining or self._first_tokens_due)

    def _next(self) -> Any:
        self._step_started = time.perf_counter()
        self._ended.clear()
        self.carry.new_step()
        self.prefill_batch_size = self._admission_limit()
        self._turns.intersection_update(self._prompt_batch.uids + [seq[0] for seq in self._unprocessed_sequences])
        joining = self._joining_this_step()
        hold = self._hold_prefill(joining)
        self._first_tokens_due = {uid for uid in joining if uid not in self._pending}
        if not hold or self._admits():
            self._settle_carry()
        if hold:
            chunk_size, self.prefill_step_size = self.prefill_step_size, 0
            try:
                result = super()._next()
            finally:
                self.prefill_step_size = chunk_size
            self.held_prefill_steps += 1
        else:
            result = self._step_fused_when_possible()
            if len(self._generation_batch) > 0:  # prompts that took a chunk beside running streams
                for uid in self._prompt_batch.uids:
                    self._steps_beside_streams[uid] = self._steps_beside_streams.get(uid, 0) + 1
        result = self._drop_pending_outputs(result)
        self._pending.update(self._repeating)
        self._repeating.clear()
        return result

    def _admit_lone_prompt(self) -> None:
        """Admits a lone waiting prompt before the step, as mlx-lm's `_next` would within it.

        mlx-lm moves a waiting prompt into the prompt batch in the middle of a step, so its
        first chunk could not ride in the decode pass (`_fusable_chunk` needs the prompt batch
        settled before the step) and costs a weight read of its own: the newcomer's first step
        beside running streams would be its dearest. Admitting it first makes that step fusable,
        and with nothing decoding lets a prompt that fits one chunk hand back its first token
        from that chunk's step (`_lone_prompt_end`).
        """
        if not (self.fuse and self._unprocessed_sequences):
            return
        if self._currently_processing or len(self._prompt_batch):
            return
        room = min(self.prefill_batch_size, self.completion_batch_size - len(self._generation_batch))
        if room >= 1 and (len(self._unprocessed_sequences) == 1 or self.prefill_batch_size == 1):
            self._prompt_batch.extend(self._make_batch(1))

    def _step_fused_when_possible(self) -> Any:
        self._admit_lone_prompt()
        planned = self._fusable_chunk()
        if planned is None:
            self._settle_carry(keep=False)
            lone = self._lone_prompt_end()
            return super()._next() if lone is None else self._step_ending(lone)
        chunk, ends_prompt = planned
        if ends_prompt:
            return self._step_ending(chunk)
        decode, prompt = self._generation_batch, self._prompt_batch
        carry = self.carry.taken()
        cuttable = len(self._currently_processing[0][0][0]) > len(chunk)  # its segment goes on after it
        deadline = self.carry.step_deadline(self._step_started, len(chunk), carry) if cuttable else None
        fused = FusedDecode(self.model, chunk, prompt.prompt_cache, carry=carry, leaving=deadline)
        recorded = ChunkRecorded(prompt, chunk)
        decode.model, prompt.prompt = fused, recorded
        size, self.prefill_step_size = self.prefill_step_size, len(chunk)  # mlx-lm takes the chunk (carry: smaller)
        try:
            result = super()._next()
        finally:
            decode.model, self.prefill_step_size = self.model, size
            del prompt.prompt
        if not (fused.used and recorded.used):  # cannot happen while _fusable_chunk matches mlx-lm's _next
            raise RuntimeError("fused prefill chunk was not computed")
        self.fused_steps += 1
        self.carry.stepped(prompt.uids[0], chunk, carry, fused.carried, ended=time.perf_counter())
        self.join_reserve.prepare(prompt.uids[0], decode.prompt_cache, prompt.prompt_cache,
                                  len(_rest(self._currently_processing[0][0])) if self._currently_processing else 0)
        return result

    def _settle_carry(self, keep: bool = True) -> None:
        """Rolls a carry back unless this step can take it on (`keep`: a fused step of the same lone prompt may)."""
        survives = (keep and self._prompt_batch.uids == [self.carry.uid] and not self._admits()
                    and len(self._generation_batch) > 0)
        if self.carry.carry is not None and not survives:
            self.carry.roll_back(self._prompt_batch, self._currently_processing)

    def _lone_prompt_end(self) -> list[int] | None:
        """The rest of a lone prompt, last token included, when nothing decodes and it fits this step's chunk."""
        if not self.fuse or self._admits() or len(self._currently_processing) != 1 or len(self._generation_batch):
            return None
        segments = self._currently_processing[0][0]
        return _rest(segments) if segments and self._ends_in_this_chunk(segments) else None

    def _step_ending(self, chunk: list[int]) -> Any:
        """A step whose chunk is the rest of the lone prompt: its first token comes back from this step.

        The prompt leaves the prompt batch before the step. Beside running streams, the
        fused pass fills its KV and computes its last token's logits while mlx-lm's `_next`
        only decodes (admitting nobody: the next prompt is admitted before the next step,
        where its first chunk can ride in the pass); with nothing decoding, the chunk's own
        pass does (`prompt_end_logits`). Either way the prompt joins as mlx-lm's split
        would have joined it a step later, with the same progress response, and its first
        token is handed back now (`first_token_now`), two steps sooner than mlx-lm's path.
        """
        carry = self.carry.taken()  # only beside streams (`_fusable_chunk`): nothing decoding rolled it back
        uid, (_segments, _done, total) = self._prompt_batch.uids[0], self._currently_processing.pop()
        self._steps_beside_streams.pop(uid, None)
        self._first_tokens_due.discard(uid)  # counted as joining (its rest was its last token): handed back now
        moved = _split(self._prompt_batch, [0])
        if len(self._generation_batch) == 0:
            prompt_responses, generation_responses = [], []
            logits = prompt_end_logits(self.model, mx.array([chunk]), moved.prompt_cache)
        else:
            fused = FusedDecode(self.model, chunk, moved.prompt_cache, ends_prompt=True, carry=carry)
            decode, admission = self._generation_batch, self.prefill_batch_size
            decode.model, self.prefill_batch_size = fused, 0
            try:
                prompt_responses, generation_responses = super()._next()
            finally:
                decode.model, self.prefill_batch_size = self.model, admission
            if fused.prompt_logits is None:  # cannot happen while _fusable_chunk matches mlx-lm's _next
                raise RuntimeError("fused prefill chunk ending its prompt was not computed")
            logits = fused.prompt_logits
            self.fused_steps += 1
        moved.tokens[0] += chunk[:-1]  # what the KV holds before the first step appends the last token
        generation = joined_with_logits(moved, chunk[-1:], logits)
        first, matcher = first_token_now(generation)
        if first.finish_reason is None:
            self._ended[uid] = list(generation.prompt_cache)  # before the join replaces them
            self._generation_batch.extend(generation)
            self._repeating[uid] = matcher
        prompt_responses.append(PromptProcessingBatch.Response(uid, (total, total), True, True))
        generation_responses.append(first)
        self.first_tokens_at_prefill_end += 1
        return prompt_responses, generation_responses
