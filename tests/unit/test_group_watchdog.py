"""Rank 0's step watchdog, on a simulated clock: a hung step fires it, a pause of rank 0 itself does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_daemon.group import watchdog


class Ticks:
    """Stands in for the halt event: each wait moves the clock by one period, or by `jumps[n]` on wait n."""

    def __init__(self, clock: list[float], jumps: dict[int, float], waits: int):
        self.clock, self.jumps, self.waits, self.n = clock, jumps, waits, 0

    def wait(self, period: float) -> bool:
        self.n += 1
        self.clock[0] += self.jumps.get(self.n, period)
        return self.n > self.waits


def run(monkeypatch: pytest.MonkeyPatch, jumps: dict[int, float], waits: int) -> list[float]:
    clock = [100.0]
    monkeypatch.setattr(watchdog, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    lockstep = SimpleNamespace(in_step_since=100.0, tick=7)  # one step, running since the start
    fired: list[float] = []
    dog = watchdog.StepWatchdog(lockstep, timeout=3.0, on_hang=fired.append, period=0.1)
    dog._halt = Ticks(clock, jumps, waits)
    dog.run()
    return fired


def test_a_step_past_the_timeout_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    fired = run(monkeypatch, {}, waits=40)  # 4 s of 0.1 s ticks
    assert len(fired) == 1 and 3.0 < fired[0] <= 3.2


def test_rank_0_standing_still_is_not_the_steps_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Red team: SIGSTOP of rank 0 for 6 s failed a healthy group (and blamed rank 1)."""
    assert run(monkeypatch, {5: 6.0}, waits=20) == []  # 6 s stood still, then 1.5 s of step: no hang
    fired = run(monkeypatch, {5: 6.0}, waits=45)  # ...but a step that then runs past 3 s still fires
    assert len(fired) == 1 and 3.0 < fired[0] <= 3.2


def judged(monkeypatch: pytest.MonkeyPatch, prefill: int, progress: dict, silent: float = 0.0,
           waits: int = 400) -> tuple[list[float], watchdog.StepWatchdog]:
    """A step at tick 7 with rank 1's heartbeats `silent` s old at the start (kept fresh otherwise)."""
    clock = [100.0]
    monkeypatch.setattr(watchdog, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    lockstep = SimpleNamespace(in_step_since=100.0, tick=8, in_flight_tick=7, in_flight_prefill=prefill)

    class Control:
        size = 2

        @property
        def last_seen(self) -> dict[int, float]:
            return {1: 100.0 - silent if silent else clock[0]}

    control = Control()
    control.progress = progress
    fired: list[float] = []
    dog = watchdog.StepWatchdog(lockstep, timeout=3.0, on_hang=fired.append, period=0.1, control=control)
    dog._halt = Ticks(clock, {}, waits)
    dog.run()
    return fired, dog


def test_a_decode_step_every_rank_is_inside_still_fails_at_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    fired, dog = judged(monkeypatch, prefill=0, progress={1: (7, True)})
    assert len(fired) == 1 and 3.0 < fired[0] <= 3.2
    assert dog.verdict == ("every rank is alive and inside this decode step: a rank's step is wedged", None)


def test_a_prefill_step_every_rank_is_alive_inside_may_run_longer(monkeypatch: pytest.MonkeyPatch) -> None:
    """128 tokens: up to 3 × (1 + 128/64) = 9 s; a healthy group is not failed at 3 s, a wedged one still is."""
    assert judged(monkeypatch, prefill=128, progress={1: (7, True)}, waits=85)[0] == []  # 8.5 s
    fired, dog = judged(monkeypatch, prefill=128, progress={1: (7, True)})
    assert len(fired) == 1 and 9.0 < fired[0] <= 9.2 and dog.slow_steps == 1
    assert "prefills up to 128 tokens" in dog.verdict[0]
    # 4,096 tokens would be 3 × 65 s: the allowance stops at 8 × the timeout (24 s), a wedged rank is caught.
    fired, _ = judged(monkeypatch, prefill=4096, progress={1: (7, True)})
    assert len(fired) == 1 and 24.0 < fired[0] <= 24.2


def test_a_rank_that_never_took_the_plan_or_went_silent_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fired, dog = judged(monkeypatch, prefill=2048, progress={1: (6, False)})
    assert len(fired) == 1 and fired[0] <= 3.2 and dog.verdict[1] == 1 and "never took tick 7" in dog.verdict[0]
    fired, dog = judged(monkeypatch, prefill=2048, progress={1: (7, True)}, silent=0.5)  # SIGSTOP mid-prefill
    assert len(fired) == 1 and fired[0] <= 3.2 and dog.verdict == ("rank 1 sent no heartbeat for 3.6 s: it hangs", 1)
