"""When a request that wakes an idle engine waits for companions (`worth_coalescing`)."""

from __future__ import annotations

from engine_daemon.scheduling.coalesce import COALESCE_FACTOR, UNMEASURED_MINIMUM, worth_coalescing

WINDOW = 0.008


def test_a_long_prefill_waits_and_a_short_one_does_not() -> None:
    seconds_per_token = 0.007  # the 0.5B CPU model
    long_enough = int(COALESCE_FACTOR * WINDOW / seconds_per_token) + 1
    assert worth_coalescing(long_enough, seconds_per_token, WINDOW)
    assert not worth_coalescing(long_enough - 2, seconds_per_token, WINDOW)


def test_a_fast_model_does_not_wait_for_the_same_prompt() -> None:
    assert worth_coalescing(150, 0.007, WINDOW)  # ~1 s of prefill: an 8 ms wait is <1% of it
    assert not worth_coalescing(150, 0.00005, WINDOW)  # 7.5 ms of prefill: the wait would double it


def test_before_any_prefill_was_measured_the_prompt_length_decides() -> None:
    assert worth_coalescing(UNMEASURED_MINIMUM, None, WINDOW)
    assert not worth_coalescing(UNMEASURED_MINIMUM - 1, None, WINDOW)


def test_a_zero_window_or_nothing_to_prefill_never_waits() -> None:
    assert not worth_coalescing(10_000, 0.007, 0.0)
    assert not worth_coalescing(0, 0.007, WINDOW)
    assert not worth_coalescing(0, None, WINDOW)
