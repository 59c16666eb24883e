"""A fused step's chunk cut between layers (`LayerCarry`): the same greedy tokens, and rolled back when it must be."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from engine_daemon.generation.layer_carry import CarryKeeper, LayerCarry, LayerDeadline, Leaving
from engine_daemon.generation.stall_free import StallFreeBatchGenerator
from model_builders.text import build_model

LAYERS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = build_model(tmp_path_factory.mktemp("carry") / "m", size="tiny-group", arch="qwen2")
    loaded, _ = load(str(Path(path)))
    return loaded


def cutting(generator: StallFreeBatchGenerator, layers: itertools.cycle,
            leaving: Leaving = Leaving.ALL) -> StallFreeBatchGenerator:
    """Every fused step's prompt rows (`leaving`) leave its pass before the next layer of `layers` (0: they go
    through); ALL takes the new chunk alone where the carry rejoined at that layer."""
    def step_deadline(_started: float, *_rows: Any):
        stop = next(layers)
        return (lambda index: leaving if index >= stop else Leaving.NOTHING) if stop else None

    generator.carry.step_deadline = step_deadline  # type: ignore[method-assign]
    return generator


def cutting_to_the_end(model: Any, ending: int) -> StallFreeBatchGenerator:
    """Every cuttable step cut at layer 2, with cuts on as the scheduler turns them on, and a prompt's ending step
    limited to `ending` tokens (`ending_chunk`)."""
    generator = cutting(StallFreeBatchGenerator(model, prefill_step_size=16), itertools.cycle([2]))
    generator.ending_chunk = ending
    generator.carry.deadline = (1.0, 0.1)  # the scheduler's: cuts are on (`cutting` decides them)
    return generator


def recorded(generator: StallFreeBatchGenerator) -> list[tuple[int, int, int]]:
    """(layer, carried tokens, the step's chunk tokens) of each cut the generator's steps make, as they make them."""
    cuts: list[tuple[int, int, int]] = []
    stepped = generator.carry.stepped

    def recording(uid, chunk, carry, cut, ended=None):
        if cut is not None:
            cuts.append((cut.start, len(cut.tokens), len(chunk)))
        stepped(uid, chunk, carry, cut, ended)

    generator.carry.stepped = recording  # type: ignore[method-assign]
    return cuts


def run(generator: BatchGenerator, events: dict[int, tuple[str, Any]], streams: int = 3,
        stream_tokens: int = 40) -> dict[int, list[int]]:
    """Greedy tokens per insertion order; `events` maps a step to ("insert", prompt) or ("remove", index)."""
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(5 + 3 * i)] for i in range(streams)]
    uids = list(generator.insert(prompts, max_tokens=[stream_tokens] * streams))
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    live, step = set(uids), 0
    while live:
        kind, value = events.get(step, (None, None))
        if kind == "insert":
            (uid,) = generator.insert([value], max_tokens=[6])
            uids.append(uid)
            out[uid] = []
            live.add(uid)
        elif kind == "remove":
            generator.remove([uids[value]])
            live.discard(uids[value])
        _, responses = generator.next()
        for response in responses:
            if response.uid in live:
                out[response.uid].append(response.token)
                if response.finish_reason is not None:
                    live.discard(response.uid)
        step += 1
    return {index: out[uid] for index, uid in enumerate(uids)}


LATE = [(13 * j) % 2000 + 3 for j in range(150)]
SECOND = [(17 * j) % 2000 + 5 for j in range(40)]


def test_cut_chunks_give_the_same_greedy_tokens(model) -> None:
    plain = run(BatchGenerator(model, prefill_step_size=16), {3: ("insert", LATE)})
    generator = cutting(StallFreeBatchGenerator(model, prefill_step_size=16), itertools.cycle([1, 3, 2, 0, 2]))
    cuts = recorded(generator)
    cut = run(generator, {3: ("insert", LATE)})
    assert generator.carry.cuts >= 4 and generator.fused_steps >= 5
    assert generator.carry.rollbacks == 0
    assert any(tokens > chunk for _, tokens, chunk in cuts)  # a carry left again with the next chunk (layer 3)
    assert cut == plain


def test_a_carry_never_leaves_again_at_the_layer_it_rejoined(model) -> None:
    """A carry never leaves again at the layer it rejoined: cut at the last layer step after step, it stays one
    chunk's rows."""
    plain = run(BatchGenerator(model, prefill_step_size=16), {3: ("insert", LATE)})
    generator = cutting(StallFreeBatchGenerator(model, prefill_step_size=16), itertools.cycle([LAYERS - 1]))
    cuts = recorded(generator)
    cut = run(generator, {3: ("insert", LATE)})
    assert len(cuts) >= 4
    assert all(layer == LAYERS - 1 and tokens == chunk for layer, tokens, chunk in cuts)  # its own chunk's rows only
    assert cut == plain


def test_a_carry_is_rolled_back_when_a_second_prompt_joins(model) -> None:
    events = {3: ("insert", LATE), 6: ("insert", SECOND)}
    plain = run(BatchGenerator(model, prefill_step_size=16), events)
    generator = cutting(StallFreeBatchGenerator(model, prefill_step_size=16), itertools.cycle([2]))
    cut = run(generator, events)
    assert generator.carry.rollbacks >= 1  # the second prompt batches with the first on mlx-lm's path
    assert cut == plain


def test_removing_the_carrying_prompt_leaves_the_streams_as_they_were(model) -> None:
    events = {3: ("insert", LATE), 6: ("remove", 3)}
    plain = run(BatchGenerator(model, prefill_step_size=16), events)
    generator = cutting(StallFreeBatchGenerator(model, prefill_step_size=16), itertools.cycle([3]))
    cut = run(generator, events)
    assert generator.carry.cuts >= 1 and generator.carry.carry is None
    assert cut == plain


def test_the_streams_ending_roll_the_carry_back(model) -> None:
    """Streams that finish mid-prompt leave it alone: mlx-lm's prompt path takes it on, whole."""
    events = {2: ("insert", LATE)}
    plain = run(BatchGenerator(model, prefill_step_size=16), events, streams=2, stream_tokens=6)
    generator = cutting(StallFreeBatchGenerator(model, prefill_step_size=16), itertools.cycle([2]))
    cut = run(generator, events, streams=2, stream_tokens=6)
    assert generator.carry.rollbacks >= 1
    assert cut == plain


def test_layer_deadline_cuts_when_the_step_would_pass_its_bound() -> None:
    now = [0.0]
    early = LayerDeadline(bound=1.0, decode_layer=0.05, layers=12, started=0.0, clock=lambda: now[0])
    now[0] = 0.9
    assert early(3) == Leaving.NOTHING  # the first half of the layers: never cut
    deadline = LayerDeadline(bound=1.0, decode_layer=0.05, layers=12, started=0.0, clock=lambda: now[0])
    now[0] = 0.55  # 5.5 layers' worth done before layer 6: 0.1 s a layer
    assert deadline(6) == Leaving.NOTHING  # 0.55 + 0.15 + 5 * 0.05 = 0.95
    now[0] = 0.75  # before layer 8: 0.75 + 0.15 * 1.5 ... running late
    assert deadline(8) == Leaving.CHUNK
    assert deadline.cut_at == 8


def test_layer_deadline_paces_from_its_first_decision_not_from_the_steps_start() -> None:
    """The time before the first layer holds the step's setup and what the previous step left to evaluate: read as
    rows' work, it made every later layer look dearer, and steps ended a median 16 ms (9%) before their decisions
    expected (~85M model). Here 0.5 s of setup, then 0.1 s a layer (0.05 decode + 50 rows at 1 ms)."""
    now = [0.55]  # before layer 1: the setup and half of layer 0

    def deadline() -> LayerDeadline:
        return LayerDeadline(bound=1.75, decode_layer=0.05, layers=12, started=0.0, clock=lambda: now[0],
                             chunk_rows=50)

    paced = deadline()
    assert paced(1) == Leaving.NOTHING
    now[0] = 1.55  # before the last layer
    # 1.55 + the rest of layer 10 (0.05) + layer 11 (0.1) = 1.7, within the bound: the chunk goes through it
    assert paced(11) == Leaving.NOTHING and paced.expected == pytest.approx(1.7)
    # Paced from the step's start, the setup reads as ~1.95 ms a row: 1.77 s going on, so the chunk would leave.
    assert deadline()(11) == Leaving.CHUNK


def test_layer_deadline_counts_the_rows_a_carry_adds_to_later_layers() -> None:
    """A pace taken per layer would read the first layers' rows as every layer's: the carry's layers cost more."""
    now = [0.33]  # 5.5 layers of 50 chunk rows before layer 6: 0.01 s decode + 0.001 s a row, a layer
    ahead = LayerDeadline(bound=0.6, decode_layer=0.01, layers=12, started=0.0, clock=lambda: now[0],
                          chunk_rows=50, carry_rows=100, carry_start=8)
    # 0.36 + 0.06 + 0.01 + 0.1 (the carry's first layer, 8) + 4 * 0.01 = 0.57 against 0.47 with no carry
    assert ahead(6) == Leaving.NOTHING
    now[0] = 0.56  # before layer 9: 8.5 layers' decode rows, 475 prompt rows (the carry's 100 from layer 8)
    tight = LayerDeadline(bound=0.75, decode_layer=0.01, layers=12, started=0.0, clock=lambda: now[0],
                          chunk_rows=50, carry_rows=100, carry_start=8)
    # going on: 0.64 (layer 8 finished) + 0.16 + 2 * 0.01 = 0.82; the chunk leaving, the carry through layers
    # 9-11: 0.64 + 3 * 0.11 = 0.97; both leaving: 0.64 + 3 * 0.01 = 0.67
    assert tight(9) == Leaving.ALL and tight.expected == pytest.approx(0.67)
    now[0] = 0.88  # before the last layer: 10.5 layers' decode rows, 775 prompt rows
    last = LayerDeadline(bound=1.1, decode_layer=0.01, layers=12, started=0.0, clock=lambda: now[0],
                         chunk_rows=50, carry_rows=100, carry_start=8)
    # going on: 0.96 + 0.16 = 1.12; the chunk leaving: 0.96 + 0.11 = 1.07, within the bound
    assert last(11) == Leaving.CHUNK and last.expected == pytest.approx(1.07)
    now[0] = 0.56
    rejoining = LayerDeadline(bound=0.75, decode_layer=0.01, layers=12, started=0.0, clock=lambda: now[0],
                              chunk_rows=50, carry_rows=100, carry_start=9)
    # The carry rejoins at layer 9 and cannot leave before it went through it. Nothing fits: the chunk leaving
    # now sends the carry through layers 9-11 (0.96), going on lets both leave after layer 9 (0.79).
    assert rejoining(9) == Leaving.NOTHING and rejoining.cut_at is None
    now[0] = 0.72
    assert rejoining(10) == Leaving.ALL and rejoining.cut_at == 10


def test_the_step_past_its_last_decision_is_learnt_and_left_room_for() -> None:
    """The output head, sampling and the hand-back come after the last layer: a cut must leave them room."""
    keeper = CarryKeeper(12)
    keeper.deadline = (1.0, 0.6)  # 0.05 s a decode layer
    now = [0.55]  # 5.5 layers' worth before layer 6: 0.1 s a layer
    deadline = keeper.step_deadline(started=0.0)
    deadline.clock = lambda: now[0]
    assert deadline(6) == Leaving.NOTHING  # 0.55 + 0.15 + 5 * 0.05 = 0.95, and no tail learnt yet
    keeper.stepped(0, [1] * 8, None, None, ended=1.15)  # the step ended 0.2 s after what that decision expected
    assert keeper.tail == pytest.approx(0.3 * 0.2)
    again = keeper.step_deadline(started=0.0)
    again.clock = lambda: now[0]
    assert again(6) == Leaving.CHUNK and again.cut_at == 6  # 0.95 + the tail passes the bound


def test_the_chunk_before_the_ending_step_leaves_it_a_token_so_it_can_be_cut(model) -> None:
    """A chunk that would end the prompt's body leaves one token to the ending step: it can then leave its pass.

    The ending step is kept small (`ending_chunk`), so the rest before the last token goes through an ordinary
    chunk first; ending its segment, such a chunk could not be cut, and beside a carry its step took 1.6 s where
    the bound was 1.1 (0.5B CPU model).
    """
    before_ending_cuts = 0
    for length in range(120, 152, 5):
        late = [(13 * j) % 2000 + 3 for j in range(length)]
        plain = run(BatchGenerator(model, prefill_step_size=16), {3: ("insert", late)})
        generator = cutting_to_the_end(model, ending=2)
        stepped = generator.carry.stepped

        def recording(uid, chunk, carry, cut, ended=None, generator=generator, stepped=stepped):
            nonlocal before_ending_cuts
            segments = generator._currently_processing[0][0] if generator._currently_processing else []
            assert segments and len(segments[-1]) == 1  # the body's rest, then the last token's own segment
            before_ending_cuts += cut is not None and len(segments) == 2 and len(segments[0]) == 1
            stepped(uid, chunk, carry, cut, ended)

        generator.carry.stepped = recording  # type: ignore[method-assign]
        assert run(generator, {3: ("insert", late)}) == plain, length
    assert before_ending_cuts >= 3


def test_a_carry_is_finished_before_the_step_that_ends_its_prompt(model) -> None:
    """The ending step is never cut and also joins the prompt to the streams: a carry finished in it made it 3.3x
    the streams' steady gap (a 58-row carry at layer 7 of 12, ~85M model). Its remaining layers count against
    the ending step's room (`ending_chunk`), so a larger carry is finished in a step of its own first; the tokens
    are mlx-lm's."""
    over_room, endings = [], 0
    for length in range(120, 152, 5):
        late = [(11 * j) % 2000 + 5 for j in range(length)]
        plain = run(BatchGenerator(model, prefill_step_size=16), {3: ("insert", late)})
        generator = cutting_to_the_end(model, ending=3)
        step_ending = generator._step_ending

        def recording(chunk, generator=generator, step_ending=step_ending):
            nonlocal endings
            endings += 1
            carry = generator.carry.carry
            work = len(chunk) + (carry.remaining_fraction(generator.carry.layers) if carry is not None else 0)
            if work > generator.ending_chunk:
                over_room.append(work)
            return step_ending(chunk)

        generator._step_ending = recording  # type: ignore[method-assign]
        assert run(generator, {3: ("insert", late)}) == plain, length
    assert endings >= 7 and over_room == []


def passes_rows(generator: StallFreeBatchGenerator) -> list[int]:
    """Rows of each fused pass the generator's steps take in (decode rows, the carry rejoining, the new chunk)."""
    rows: list[int] = []
    stepped = generator.carry.stepped

    def recording(uid, chunk, carry, cut, ended=None):
        rows.append(len(generator._generation_batch) + len(chunk) + (len(carry.tokens) if carry is not None else 0))
        stepped(uid, chunk, carry, cut, ended)

    generator.carry.stepped = recording  # type: ignore[method-assign]
    return rows


@pytest.mark.parametrize("cap", [64, None])
def test_a_pass_with_cuts_takes_at_most_pass_rows_its_carry_included(model, monkeypatch, cap) -> None:
    """Each cut adds its chunk's rows to the carry, and a carry cannot leave at the layer it rejoins: grown to
    200-300 rows, its last layers cost 30-45 ms each that no cut could shorten (~85M CPU model). With cuts on, the
    new chunk shrinks so that the pass holds at most `PASS_ROWS` rows, the carry's included; the tokens are
    mlx-lm's. Without the cap (None: the default, far above these chunks) the same steps take larger passes."""
    if cap is not None:
        monkeypatch.setattr("engine_daemon.generation.layer_carry.PASS_ROWS", cap)
    longer = [(13 * j) % 2000 + 3 for j in range(300)]
    plain = run(BatchGenerator(model, prefill_step_size=48), {3: ("insert", longer)})
    generator = cutting(StallFreeBatchGenerator(model, prefill_step_size=48), itertools.cycle([2]))
    generator.carry.deadline = (1.0, 0.1)  # the scheduler's: cuts are on (`cutting` decides them)
    rows = passes_rows(generator)
    assert run(generator, {3: ("insert", longer)}) == plain
    assert len(rows) >= 4
    if cap is not None:
        assert max(rows) <= cap
    else:
        assert max(rows) > 64


def test_without_a_deadline_a_chunk_is_not_capped() -> None:
    """The cap is for passes that cuts bound (the CPU): without a deadline a chunk keeps the pacer's size."""
    keeper = CarryKeeper(12)
    assert keeper.shrunk(220, 4, 16) == 220
    keeper.deadline = (0.3, 0.1)
    assert keeper.shrunk(220, 4, 16) == 156  # 160 rows with the 4 decode rows
    assert keeper.shrunk(92, 4, 16) == 92
    keeper.carry = LayerCarry(mx.zeros((150, 8)), 8, list(range(150)))
    assert keeper.shrunk(92, 4, 16) == 12  # one tile of rows beside a carry past the cap
    assert keeper.shrunk(8, 4, 16) == 8  # never more than the pacer's chunk


def test_a_late_carry_leaves_the_new_chunk_its_rows_and_never_leaves_again() -> None:
    """A carry with two of twelve layers left (cut at layer 10) takes a fifth of a chunk's work in the next step;
    counted against `PASS_ROWS` it left the new chunk one tile. Now the new chunk gets the rows the cap allows
    without it, less the carry's work, and the carry cannot leave again (no carry grows past one chunk)."""
    keeper = CarryKeeper(12)
    keeper.deadline = (0.3, 0.1)
    keeper.carry = LayerCarry(mx.zeros((150, 8)), 10, list(range(150)))
    assert keeper.late(keeper.carry)
    assert keeper.shrunk(92, 4, 16) == 76  # 92 less the carry's 25 tokens of work, grown to whole tiles of rows
    assert keeper.shrunk(220, 4, 16) == 156  # still at most PASS_ROWS of its own
    deadline = keeper.step_deadline(0.0, 76, keeper.carry)
    assert deadline is not None and deadline.carry_stays
    assert not keeper.late(LayerCarry(mx.zeros((150, 8)), 9, list(range(150))))  # three layers left
    now = [0.72]
    stays = LayerDeadline(bound=0.75, decode_layer=0.01, layers=12, started=0.0, clock=lambda: now[0],
                          chunk_rows=50, carry_rows=100, carry_start=9, carry_stays=True)
    assert stays(10) == Leaving.CHUNK  # where a carry that may leave would leave with the chunk (`ALL`)
