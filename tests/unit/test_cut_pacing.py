"""The pacer with cuts between layers (`PrefillPacer.step_deadline`): a bound per step, and chunks sized to reach it."""

import pytest

from engine_daemon.scheduling.prefill_pacer import CUT_MARGIN, CUT_OVERSIZE, PrefillPacer

DECODE, STREAMS, ALONE_RATE = 0.1, 4, 0.003


def _pacer(**options) -> PrefillPacer:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=2.0, first=32, spread=True, tile=16,
                         ttft_ratio=1.5, **options)
    for _ in range(4):  # a prompt prefilled alone at full speed: its cost per token, the reference
        pacer.observe(ALONE_RATE * 300, decoding=0, prompt_tokens=300, prefilling=1)
    for _ in range(12):
        pacer.observe(DECODE, decoding=STREAMS, prompt_tokens=0)
    return pacer


def test_a_lone_prompt_beside_streams_gets_a_bound_under_the_gap_target() -> None:
    pacer = _pacer(cuts=True)
    pacer.chunk(STREAMS, 1)
    assert pacer.step_deadline() == pytest.approx((3.0 * DECODE / CUT_MARGIN, DECODE))
    pacer.chunk(STREAMS, 2)  # two prompts: mlx-lm's path, nothing to cut
    assert pacer.step_deadline() is None
    off = _pacer(cuts=False)
    off.chunk(STREAMS, 1)
    assert off.step_deadline() is None
    fixed = _pacer(cuts=True)
    fixed.fixed = 64  # the operator's --interleave-prefill-tokens
    fixed.chunk(STREAMS, 1)
    assert fixed.step_deadline() is None


def test_the_first_chunk_is_sized_from_the_alone_rate_past_its_plan() -> None:
    """No ramp from 32 tokens: the cut bounds a chunk too large for its step, and the carry shrinks the next."""
    pacer = _pacer(cuts=True)
    chunk = pacer.chunk(STREAMS, 1)
    planned = (3.0 / CUT_MARGIN - 1) * DECODE / ALONE_RATE * CUT_OVERSIZE  # mean spread 1 until steps are seen
    assert abs(chunk - planned) < 16 and (chunk + STREAMS) % 16 == 0
    plain = _pacer(cuts=False).chunk(STREAMS, 1)
    assert plain == 32 and chunk > 1.5 * plain


def test_with_cuts_the_chunk_is_not_held_to_its_growth_and_the_ttft_balance_stays_out() -> None:
    pacer = _pacer(cuts=True)
    pacer.chunk(STREAMS, 1)
    pacer.observe(DECODE + 0.0005 * 40, decoding=STREAMS, prompt_tokens=40)  # cheap tokens: 0.5 ms each
    chunk = pacer.chunk(STREAMS, 1)
    target = pacer.target_seconds()
    assert chunk > 1.25 * 40 + 16  # `GROWTH_PER_STEP` would have held it near 56
    assert abs(chunk - target / 0.0005 * CUT_OVERSIZE) <= 16 or chunk == pacer.maximum
    assert not pacer.balanced  # a paced token at a sixth of a full-speed one would have planned far lower


def test_the_step_that_ends_a_prompt_is_planned_as_an_uncut_one() -> None:
    """Its last token's logits are due, so no cut can end it: it takes what a step without cuts would."""
    pacer = _pacer(cuts=True)
    pacer.chunk(STREAMS, 1)
    pacer.observe(DECODE + 0.002 * 60, decoding=STREAMS, prompt_tokens=60)
    cut_chunk = pacer.chunk(STREAMS, 1)
    ending = pacer.ending_chunk()
    assert ending is not None  # even before a join's cost is learnt
    uncut = pacer._target_for(STREAMS, cut=False) / 0.002
    assert ending == int(uncut) and ending < cut_chunk
    assert _pacer(cuts=False).ending_chunk() is None  # without cuts: only once a join's cost is known


def test_cut_steps_costing_their_bound_are_not_read_as_a_cost_floor() -> None:
    """A cut step ends at its bound whatever work it did: small work at the whole target is what `CostFloor` takes
    for a GPU's dispatch floor. Read so, it sized a 236-token chunk on the ~85M CPU model, a 552 ms step where the
    bound was 303 ms. Without cuts the same steps still switch the floor on (a GPU's case)."""
    chunks = {}
    for cuts in (True, False):
        pacer = _pacer(cuts=cuts)
        pacer.chunk(STREAMS, 1)
        step = DECODE + 1.01 * pacer.target_seconds()  # every step ends at the target, whatever its work
        for work in (60, 24, 44, 16, 30, 60, 20):
            pacer.observe(step, decoding=STREAMS, prompt_tokens=work)
            pacer.chunk(STREAMS, 1)
        chunks[cuts] = pacer.chunk(STREAMS, 1)
        assert (pacer._floor.floor is not None) is True  # the fit sees a floor either way
    assert chunks[False] > 150  # the floor's chunk: its work equal to the floor
    assert chunks[True] < 100, chunks  # with cuts: paced by the cost per token, the cut bounding the step
