"""A fused step's chunk cut between layers (`LayerCarry`): the same greedy tokens, and rolled back when it must be."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from engine_daemon.generation.layer_carry import CarryKeeper, LayerDeadline
from engine_daemon.generation.stall_free import StallFreeBatchGenerator
from model_builders.text import build_model

LAYERS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = build_model(tmp_path_factory.mktemp("carry") / "m", size="tiny-group", arch="qwen2")
    loaded, _ = load(str(Path(path)))
    return loaded


def cutting(generator: StallFreeBatchGenerator, layers: itertools.cycle) -> StallFreeBatchGenerator:
    """Every fused step's chunk leaves its pass before the next layer of `layers` (0: it goes through)."""
    def keep_going(_started: float):
        stop = next(layers)
        return (lambda index: index < stop) if stop else None

    generator.carry.keep_going = keep_going  # type: ignore[method-assign]
    return generator


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
    cut = run(generator, {3: ("insert", LATE)})
    assert generator.carry.cuts >= 4 and generator.fused_steps >= 5
    assert generator.carry.rollbacks == 0
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
    deadline = LayerDeadline(bound=1.0, decode_layer=0.05, layers=12, started=0.0, clock=lambda: now[0])
    now[0] = 0.9
    assert deadline(3)  # the first half of the layers: never cut
    now[0] = 0.55  # 5.5 layers' worth done before layer 6: 0.1 s a layer
    assert deadline(6)  # 0.55 + 0.15 + 5 * 0.05 = 0.95
    now[0] = 0.75  # before layer 8: 0.75 + 0.15 * 1.5 ... running late
    assert not deadline(8)
    assert deadline.cut_at == 8


def test_the_step_past_its_last_decision_is_learnt_and_left_room_for() -> None:
    """The output head, sampling and the hand-back come after the last layer: a cut must leave them room."""
    keeper = CarryKeeper(12)
    keeper.deadline = (1.0, 0.6)  # 0.05 s a decode layer
    now = [0.55]  # 5.5 layers' worth before layer 6: 0.1 s a layer
    deadline = keeper.keep_going(started=0.0)
    deadline.clock = lambda: now[0]
    assert deadline(6)  # 0.55 + 0.15 + 5 * 0.05 = 0.95, and no tail learnt yet
    keeper.stepped(0, [1] * 8, None, None, ended=1.15)  # the step ended 0.2 s after what that decision expected
    assert keeper.tail == pytest.approx(0.3 * 0.2)
    again = keeper.keep_going(started=0.0)
    again.clock = lambda: now[0]
    assert not again(6) and again.cut_at == 6  # 0.95 + the tail passes the bound
