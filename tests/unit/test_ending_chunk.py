"""The step that ends a prompt beside streams also joins its KV to theirs: the pacer leaves room for that join."""

from engine_daemon.scheduling.prefill_pacer import PrefillPacer

DECODE, PER_TOKEN, JOIN = 0.100, 0.002, 0.120  # a 0.5B-like CPU step: the join is 1.2 decode steps of copying


def _prompt(pacer: PrefillPacer, tokens: int, streams: int = 4) -> list[tuple[int, float, bool]]:
    """(chunk, step seconds, ended) of one prompt beside `streams`, its last step paying `JOIN`.

    The prompt ends in a step when its rest fits that step's chunk and the ending limit, as
    `StallFreeBatchGenerator._ends_in_this_chunk` decides: otherwise the rest goes in whole first.
    """
    for _ in range(48):
        pacer.observe(DECODE, decoding=streams, prompt_tokens=0)
    steps, rest = [], tokens
    while rest:
        chunk, ending = pacer.chunk(streams, 1), pacer.ending_chunk()
        ends = rest <= min(chunk, ending if ending is not None else chunk)
        taken = rest if ends else min(chunk, max(1, rest - 1) if rest <= chunk else chunk)
        seconds = DECODE + PER_TOKEN * taken + (JOIN if ends else 0.0)
        pacer.observe(seconds, decoding=streams, prompt_tokens=taken, ended=ends)
        steps.append((taken, seconds, ends))
        rest -= taken
    for _ in range(3):
        pacer.observe(DECODE, decoding=streams + 1, prompt_tokens=0, prefilling=0)  # the prompt streams now
    return steps


def test_the_join_is_learnt_from_an_ending_step_and_leaves_the_rate_alone() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=2.0, first=32)
    for _ in range(48):
        pacer.observe(DECODE, decoding=4, prompt_tokens=0)
    for chunk in (32, 48, 64, 80):
        pacer.observe(DECODE + PER_TOKEN * chunk, decoding=4, prompt_tokens=chunk)
    assert pacer.ending_chunk() is None  # nothing learnt yet: any chunk may end a prompt
    rate = pacer.seconds_per_token
    pacer.observe(DECODE + PER_TOKEN * 40 + JOIN, decoding=4, prompt_tokens=40, ended=True)
    assert abs(pacer.join_seconds - JOIN) < 1e-9 and pacer.seconds_per_token == rate
    # The prefill target is 2 decode steps (200 ms): 80 ms of it is left for tokens beside the join.
    assert pacer.ending_chunk() == int((2 * DECODE - JOIN) / rate) == 40


def test_the_ending_step_of_the_next_prompt_meets_the_target() -> None:
    """Without the limit the last chunk of a full size plus the join runs 1.2 decode steps over the 3x target."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=2.0, first=32)
    first = _prompt(pacer, 1500)
    assert first[-1][1] > 3 * DECODE  # the first prompt's end paid the join unforeseen (when its rest was large)
    second = _prompt(pacer, 1500)
    assert second[-1][2], second
    assert all(seconds <= 3 * DECODE + 1e-9 for _, seconds, _ in second), second
    assert len(second) <= len(first) + 1  # one step more at most: the rest before the ending step


def test_an_operators_fixed_chunk_is_left_alone() -> None:
    pacer = PrefillPacer(64, maximum=2048, minimum=8, ratio=2.0, first=32)
    _prompt(pacer, 300)
    assert pacer.ending_chunk() is None
