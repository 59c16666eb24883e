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
