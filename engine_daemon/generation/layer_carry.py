"""A prompt chunk cut between two layers of a fused step: the rest of its layers run in the next step.

Why: the pacer sizes a chunk so that its step stays within the streams' gap target, but it
can only predict the step's cost, and on a shared CPU the same step costs up to ~1.35x its
median from one step to the next (~85M bench model, 2-core VM, in process, quiet). Planned
far enough under the target to absorb that, the steps carry so little prompt that the
newcomer's first token comes late (a paced token then costs the decode step's share too):
both targets of the long-prompt row met only half the time. A fused step on the CPU stops at
every layer anyway (the NumPy softmax needs its scores, `evaluated_together`), so it can look
at the clock there: when the step is running late, the chunk's rows leave the pass after the
layer they are in and the decode rows finish alone. The chunk's KV for the layers it passed
is in the cache and its hidden state after them is kept (`LayerCarry`); the next fused step
takes those rows in again at the layer where they stopped, before its own new chunk (they
are the positions just before it). That step may cut its new chunk alone (the carry goes
through every layer left) or, once the carry has gone through a layer in it, both (`Leaving`):
a carry moves on every step, and a late step can still end at its deadline. No work is lost,
and the step's worst case is the deadline rather than the prediction's tail, so steps can be
planned nearer the target.

While a carry is held the prompt's cache is ragged (the first layers hold more positions
than the rest). Whatever needs it whole (mlx-lm's own prompt path, a second prompt batched
in, the prompt's removal) first rolls the carry back (`roll_back`): the layers that hold its
positions drop them again and its tokens go back in front of the prompt's rest, to be
prefilled anew. Rare, and at most one chunk's partial work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import mlx.core as mx

# The fewest tiles of rows a chunk shrunk for a carry keeps (`CarryKeeper.shrunk`).
CARRY_TILES = 3
# The most rows (decode rows, carry and new chunk) a fused pass with cuts takes in (`CarryKeeper.shrunk`).
PASS_ROWS = 160
# How far one fused step's tail past its last layer decision moves the learnt one (`CarryKeeper.tail`).
TAIL_WEIGHT = 0.3
# A carry with at most this share of the layers left is late (`CarryKeeper.late`): it never leaves a pass again, and
# the new chunk beside it gets the rows `PASS_ROWS` allows without it.
LATE_CARRY_SHARE = 0.2


class Leaving(IntEnum):
    """Which prompt rows leave a fused pass before a layer (`LayerDeadline`, `fused_forward_carried`)."""

    NOTHING = 0
    CHUNK = 1  # the step's new chunk; a carry it took in goes through every layer left
    ALL = 2  # the new chunk and the carry, once the carry went through a layer in this step (else: CHUNK)


@dataclass
class LayerCarry:
    """A chunk's rows that left a fused pass before its last layer.

    `hidden`: their hidden state (rows, width) after layer `start - 1`; `tokens`: the prompt
    tokens they stand for, whose KV layers `0 .. start - 1` hold and the rest do not yet.
    """

    hidden: mx.array
    start: int
    tokens: list[int]

    def remaining_fraction(self, layers: int) -> float:
        """The carried rows' share of a whole chunk's work still to do, in tokens: what the next chunk leaves them."""
        return len(self.tokens) * (layers - self.start) / layers


def roll_back(carry: LayerCarry, cache: list[Any], batch_tokens: list[int], processing: list[Any]) -> None:
    """Undoes a carry: its layers drop its positions, its tokens go back to the front of the prompt's rest.

    `cache`: the prompt's per-layer caches (batch of one); `batch_tokens`: the prompt batch's token
    list for it (it gained the carried tokens when their chunk was taken); `processing`: mlx-lm's
    `[segments, done, total]` entry for the prompt.
    """
    count = len(carry.tokens)
    for layer_cache in cache[: carry.start]:
        layer_cache.trim(count)
    del batch_tokens[len(batch_tokens) - count:]
    segments = processing[0]
    if segments:
        segments[0] = list(carry.tokens) + list(segments[0])
    else:
        segments.append(list(carry.tokens))
    processing[1] -= count


class LayerDeadline:
    """Which prompt rows of a fused step leave the pass before the next layer, by the clock (`Leaving`).

    `bound`: seconds the whole step may take from `started`; `decode_layer`: seconds one layer of
    the decode rows alone takes (a decode step over the layers); `tail`: what the step takes after
    its last layer's scores, learnt (`CarryKeeper`): the output head over the decode rows (a
    quarter of a decode step's weights on the ~85M bench model), sampling, the hand-back.
    `chunk_rows`: the new chunk's rows; `carry_rows` rows of an earlier chunk rejoin at layer
    `carry_start`.

    A layer costs `decode_layer` plus a cost per prompt row learnt from this step's own pace since
    its first decision (the time before it holds the step's setup, not rows' work). Rows differ from
    layer to layer once a carry rejoins: a pace taken per layer, as if they did not, let a step
    whose 92-row carry doubled its last layers' rows run 20% past its bound (~85M model). Before
    layer `index` the scores of layer `index - 1` are evaluated and its tail (output projection,
    MLP) is not: about half a layer. Everything goes on when the step, with the tail, can still end
    within `bound` by rows leaving at a later layer. Otherwise the new chunk leaves, or the carry
    too where only that fits; where nothing fits, whichever ends soonest. Only one cut a step, so a
    chunk that leaves before the carry rejoins sends the carry through every layer left. The carry
    never leaves at the layer it rejoined: cut there step after step, one grew to 616 rows that a
    single step then had to take through the last layer (288 ms against a 232 ms bound). Not in the
    first half of the layers: the time until then also holds what the previous step left to evaluate
    (mlx-lm's pipelining), which a pace taken over one or two layers would read as this step's (a
    60-token chunk cut at layer 1 of 12). `expected` is what the last decision expected the step to
    take before its tail, for learning that tail.
    """

    def __init__(self, bound: float, decode_layer: float, layers: int, started: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, tail: float = 0.0, chunk_rows: int = 1,
                 carry_rows: int = 0, carry_start: int = 0, carry_stays: bool = False):
        self.bound, self.decode_layer, self.layers, self.tail = bound, decode_layer, layers, tail
        self.chunk_rows, self.carry_rows, self.carry_start = chunk_rows, carry_rows, carry_start
        self.carry_stays = carry_stays  # the carry never leaves (`Leaving.ALL` is no option): `CarryKeeper.late`
        self.clock = clock
        self.started = clock() if started is None else started
        self.cut_at: int | None = None
        self.expected: float | None = None
        self._first: tuple[int, float] | None = None  # (index, elapsed) at the step's first decision

    def __call__(self, index: int) -> Leaving:
        elapsed = self.clock() - self.started
        if self._first is None:
            self._first = (index, elapsed)
        if index < self.layers // 2:
            return Leaving.NOTHING
        layers, chunk, carry, joins = self.layers, self.chunk_rows, self.carry_rows, self.carry_start

        def rows_in(layer: int) -> int:  # with the chunk still in the pass
            return chunk + carry * (layer >= joins)

        def done_rows(before: int) -> float:  # prompt rows computed when layer `before` is reached
            return sum(rows_in(layer) for layer in range(before - 1)) + 0.5 * rows_in(before - 1)

        # The pace since the first decision: the time before it also holds the step's setup and what the
        # previous step left to evaluate, which read as rows' work made every later layer look dearer (the
        # ~85M model's steps ended a median 16 ms before their decisions expected, 9% of the step unused).
        first, at_first = self._first
        if 1 <= first < index:
            decode_time, rows = (index - first) * self.decode_layer, done_rows(index) - done_rows(first)
        else:  # no earlier decision in this step
            at_first, decode_time, rows = 0.0, (index - 0.5) * self.decode_layer, done_rows(index)
        per_row = max(0.0, elapsed - at_first - decode_time) / max(1.0, rows)
        finishing = elapsed + 0.5 * (self.decode_layer + per_row * rows_in(index - 1))

        def ending(chunk_stop: int, carry_stop: int) -> float:
            """The step's end (before its tail) if the chunk's rows leave before `chunk_stop`, the carry's before
            `carry_stop` (`layers`: never)."""
            rows = sum(chunk * (layer < chunk_stop) + carry * (joins <= layer < carry_stop)
                       for layer in range(index, layers))
            return finishing + (layers - index) * self.decode_layer + per_row * rows

        both_may_leave = max(index + 1, joins + 1)  # a carry leaves again only after a layer in this step
        may_leave = bool(carry) and not self.carry_stays
        going_on = min([ending(layers, layers)] + [ending(index + 1, layers)] * (index + 1 < layers)
                       + [ending(both_may_leave, both_may_leave)] * (may_leave and both_may_leave < layers))
        if going_on + self.tail <= self.bound:
            self.expected = going_on
            return Leaving.NOTHING
        options = [(ending(index, layers), Leaving.CHUNK)]
        if may_leave and index > joins:
            options.append((ending(index, index), Leaving.ALL))
        fitting = [option for option in options if option[0] + self.tail <= self.bound]
        # The most prompt work that fits; else the least late, which may be going on: a chunk leaving before
        # the carry rejoins sends the carry through every layer left.
        self.expected, leaving = fitting[0] if fitting else min(options + [(going_on, Leaving.NOTHING)])
        self.cut_at = index if leaving else None
        return leaving


class CarryKeeper:
    """The carry of the one prompt a generator prefills beside streams, the step's deadline, and their counts.

    `deadline`: (bound, decode step) seconds, set by the scheduler each step (None: chunks go
    through every layer).
    """

    def __init__(self, layers: int):
        self.layers = layers
        self.deadline: tuple[float, float] | None = None
        self.uid: int | None = None
        self.carry: LayerCarry | None = None
        self.cuts = self.rollbacks = 0
        self.last_cut_layer: int | None = None  # where the last step's chunk left its pass (None: it did not)
        self.last_work: float | None = None  # prompt tokens' worth of work in the last fused step
        self.tail = 0.0  # seconds a fused step takes past its last layer decision (`LayerDeadline.tail`), learnt
        self._deadline: LayerDeadline | None = None

    def new_step(self) -> None:
        self.last_cut_layer = self.last_work = None

    def shrunk(self, size: int, rows: int = 0, tile: int = 1) -> int:
        """A chunk of `size` tokens less what the carried rows' remaining layers take of the step.

        At least `CARRY_TILES` tiles of rows with the `rows` decode rows (never more than `size` for
        that floor), then grown to whole `tile`s (`ROW_TILE`: on the ~85M CPU model a product over
        20 rows took 1.47 ms where 32 took 1.16 and 16 0.68). Shrunk to a few tokens, chunks that
        followed a cut carried little of the prompt in steps that still cost the bound, and the
        cost per token the pacer learnt from them shrank the next ones (TTFT 1.79x alone, 24 steps
        for 1,524 tokens, against 1.41x in 17 steps a trial before). The deadline bounds the step.

        With a deadline, a pass also takes at most `PASS_ROWS` rows, its carry's included: each cut
        adds the chunk's rows to the carry, and a carry cannot leave at the layer it rejoins, so a
        carry grown to 200-300 rows made its last layers 30-45 ms each that no cut could shorten
        (~85M CPU model: steps whose carry rejoined at layer 10 of 12 ran past their bound by 0.26
        decode steps at the 90th percentile, every other kind by at most 0.06).
        """
        chunk = size
        if self.carry is not None:
            left = round(self.carry.remaining_fraction(self.layers))
            chunk = max(size - left, min(size, CARRY_TILES * tile - rows), 1)
        carried = len(self.carry.tokens) if self.carry is not None and not self.late(self.carry) else 0
        room = size if self.deadline is None else PASS_ROWS - rows - carried
        if chunk > room:  # whole tiles under the cap, at least one tile of rows (a carry moves on every step anyway)
            return min(size, max(room - (room + rows) % tile, tile - rows, 1))
        return chunk if self.carry is None else chunk + (-(chunk + rows)) % tile

    def late(self, carry: LayerCarry) -> bool:
        """Whether `carry` has at most `LATE_CARRY_SHARE` of the layers left: its rows pass those few layers beside
        the new chunk's and never leave again (`LayerDeadline.carry_stays`), so no carry grows past one chunk.

        Why: counted against `PASS_ROWS` like any carry, a ~150-row carry cut at layer 10 or 11 of 12 left the
        next chunk a single tile (12 tokens beside 4 streams), and those steps ended 60-130 ms under their bound
        (~85M CPU model, one step in three of a paced prompt). Its own remaining work, at most a fifth of a
        chunk's, is planned for (`shrunk`) and cannot be cut; the new chunk still can, before or after it rejoins.
        """
        return (self.layers - carry.start) <= LATE_CARRY_SHARE * self.layers

    def step_deadline(self, started: float, chunk_rows: int = 1,
                      carry: LayerCarry | None = None) -> LayerDeadline | None:
        """This step's `LayerDeadline` (the step began at `started`; `chunk_rows` new rows beside the `carry`
        it takes in), when the scheduler set one."""
        if self.deadline is None or not self.layers:
            return None
        bound, decode = self.deadline
        self._deadline = LayerDeadline(bound, decode / self.layers, self.layers, started=started, tail=self.tail,
                                       chunk_rows=chunk_rows, carry_rows=len(carry.tokens) if carry else 0,
                                       carry_start=carry.start if carry else 0,
                                       carry_stays=carry is not None and self.late(carry))
        return self._deadline

    def taken(self) -> LayerCarry | None:
        """The carry, handed to the step that completes it."""
        carry, self.carry, self.uid = self.carry, None, None
        return carry

    def stepped(self, uid: int, chunk: list[int], carry: LayerCarry | None, carried: LayerCarry | None,
                ended: float | None = None) -> None:
        """After a fused step (that `ended` then): keeps the rows its cut left, counts its work in prompt tokens,
        and learns the step's tail past its last layer decision."""
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.expected is not None and ended is not None:
            seen = max(0.0, ended - deadline.started - deadline.expected)
            self.tail += TAIL_WEIGHT * (seen - self.tail)
        stop = carried.start if carried is not None else self.layers
        carry_stop = stop if carried is not None and len(carried.tokens) > len(chunk) else self.layers
        work = len(chunk) * stop + (len(carry.tokens) * (carry_stop - carry.start) if carry is not None else 0)
        self.last_work = work / max(1, self.layers)
        self.uid, self.carry = (uid, carried) if carried is not None else (None, None)
        if carried is not None:
            self.cuts += 1
            self.last_cut_layer = carried.start

    def roll_back(self, batch: Any, processing: list[list[Any]]) -> None:
        """Undoes the carry (`roll_back`) in mlx-lm's prompt batch, if its prompt is still there."""
        uid, carry = self.uid, self.taken()
        if carry is None or uid not in batch.uids:
            return
        index = batch.uids.index(uid)
        roll_back(carry, batch.prompt_cache, batch.tokens[index], processing[index])
        self.rollbacks += 1
