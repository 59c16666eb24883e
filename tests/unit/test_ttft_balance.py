"""A lone prompt's steps go under the gap target as far as its TTFT target leaves room (`balanced_prefill_seconds`)."""

import random

import pytest

from engine_daemon.scheduling.prefill_pacer import PrefillPacer
from engine_daemon.scheduling.ttft_balance import balanced_prefill_seconds

PROMPT, STREAMS, ALONE_CHUNK = 1500, 4, 100


def test_the_balance_point_meets_both_targets_with_the_same_margin() -> None:
    decode, rate, alone = 0.3, 0.005, 0.010  # a paced token costs half a full-speed one
    seconds = balanced_prefill_seconds(decode, rate, alone, gap_ratio=3.0, ttft_ratio=1.5, spread=1.1)
    assert seconds == pytest.approx(0.5 * 2 * decode / 1.1)
    gap_use = 1.1 * (decode + seconds) / (3.0 * decode)  # the worst step over its target
    ttft_use = (rate / alone) * (1 + decode / seconds) / 1.5  # the newcomer's TTFT ratio over its target
    assert gap_use == pytest.approx(ttft_use) and gap_use < 1
    assert balanced_prefill_seconds(decode, rate, None, 3.0, 1.5, 1.1) is None  # no full-speed prefill seen
    assert balanced_prefill_seconds(decode, rate, alone, 3.0, None, 1.1) is None  # the operator turned it off


def _model(decode: float, per_token: float, growth: float, noise: random.Random):
    """A CPU step: `decode` plus `per_token` a prompt token (`growth`x that at the prompt's end), up to 25% dearer."""
    def cost(chunk: int, done: int) -> float:
        return (decode + per_token * (1 + (growth - 1) * done / PROMPT) * chunk) * noise.uniform(1.0, 1.25)
    return cost


def _run(ttft_ratio: float | None, decode: float, per_token: float, seed: int) -> tuple[float, float, list[int]]:
    """(worst step over the decode step, TTFT over alone, chunks) of a prompt prefilled alone, then beside streams."""
    cost = _model(decode, per_token, 1.8, random.Random(seed))
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=2.0, first=32, spread=True, tile=16,
                         ttft_ratio=ttft_ratio)
    alone = 0.0
    for done in range(0, PROMPT, ALONE_CHUNK):  # the same prompt sent alone: full-speed steps of ~1 s
        seconds = cost(ALONE_CHUNK, done)
        pacer.observe(seconds, decoding=0, prompt_tokens=ALONE_CHUNK, prefilling=1)
        alone += seconds
    for _ in range(48):
        pacer.observe(cost(0, 0), decoding=STREAMS, prompt_tokens=0)
    chunks, worst, paced, done = [], 0.0, 0.0, 0
    while done < PROMPT:
        chunk = min(pacer.chunk(STREAMS, 1), PROMPT - done)
        seconds = cost(chunk, done)
        pacer.observe(seconds, decoding=STREAMS, prompt_tokens=chunk)
        worst, paced, done = max(worst, seconds / decode), paced + seconds, done + chunk
        chunks.append(chunk)
    return worst, paced / alone, chunks


def test_where_a_paced_token_is_cheap_steps_are_planned_lower_and_both_targets_hold() -> None:
    """0.5B-like on a CPU: a decode step reads the weights (300 ms), a full-speed step of 100 tokens pays that read
    itself, so a paced token costs about half of a full-speed one. At the gap target alone the newcomer's TTFT is
    ~1.1x with room to spare and noisy steps break 3x; balanced, the steps are smaller and both targets hold."""
    for seed in range(6):
        plain_worst, plain_ttft, plain_chunks = _run(None, 0.3, 0.004, seed)
        worst, ttft, chunks = _run(1.5, 0.3, 0.004, seed)
        assert plain_ttft < 1.25 and plain_worst > 3.0, (seed, plain_worst, plain_ttft)
        assert worst <= 3.0 and ttft <= 1.5 and worst < plain_worst, (seed, worst, ttft)
        assert max(chunks) < max(plain_chunks)


def test_where_a_paced_token_costs_what_a_full_speed_one_does_the_gap_plan_stays() -> None:
    """~85M-like: a 100 ms decode step beside 2 ms tokens; full-speed steps carry ~500 tokens, so alone a token
    costs about what it does paced (at the same position: `AloneCosts`). The balance lies at or above the gap
    plan: the newcomer's TTFT, the target this model misses, is not traded away."""
    global ALONE_CHUNK
    saved, ALONE_CHUNK = ALONE_CHUNK, 500
    try:
        ttfts = []
        for seed in range(6):
            plain, balanced = _run(None, 0.1, 0.002, seed), _run(1.5, 0.1, 0.002, seed)
            assert balanced[1] <= plain[1] * 1.02, (seed, plain[:2], balanced[:2])
            ttfts.append(balanced[1] / plain[1])
        assert sum(ttfts) / len(ttfts) <= 1.01, ttfts
    finally:
        ALONE_CHUNK = saved
