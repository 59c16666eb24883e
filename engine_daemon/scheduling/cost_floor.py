"""A prompt's step cost that does not grow with its tokens (a GPU's dispatch-bound steps), and the chunks then.

Kept apart from `PrefillPacer`, which asks it for a chunk while the floor is on: pacing by cost
per token and sizing by a fitted floor are two rules, each with its own measurements.
"""

from __future__ import annotations

import statistics
from collections import deque


class CostFloor:
    """Whether a prompt's steps cost a floor over the target that no chunk size gets under, and the chunks then.

    Why: where a step is bound by dispatching its kernels rather than by computing (small models
    on a GPU), a chunk of 512 tokens beside running streams costs little more than one of 32
    (H100, MLX CUDA, 0.5B-shaped float32 bench model, in process: 21 ms for 60 tokens, 30 ms for
    508, against an 11 ms decode step), and on a machine that has not yet compiled a chunk size's
    kernels any step may cost several decode steps. Sized by their cost per token, the chunks
    shrink towards the minimum while every step stays over the target, and every step pays the
    floor again: a 1,500-token prompt beside 4 streams went in 12-108-token chunks and its first
    token came 11-15x later than alone, its steps still 5.7-6.9x the streams' gap.

    So the steps of the prompt's latest 256 tokens are fitted as `floor + per_token * tokens`
    (least squares over the cheapest step of each chunk size, once the sizes span 2x, which the
    shrinking itself brings about). The floor is taken to be there when a chunk of at most
    `first` tokens still cost the whole target, the fitted floor is at least half the target and
    no more than 1.25x that step, and that chunk's own work is under half the floor. The chunk is
    then sized for its work to equal the floor (`floor / per_token`; the largest meeting the
    target if that is larger): half of each step goes to the prompt, in as few steps as that
    allows, growing at most 4x a step. The pacing by cost per token takes over again once the
    fitted floor falls under a quarter of the target.

    On a CPU a chunk's cost grows with its tokens (compute-bound from ~32 rows). Fitted over a
    whole prompt, the later chunks' higher cost per token (longer context) read as a floor (a
    236-token chunk, a 413 ms step beside 50 ms decode steps on the ~85M model); over 256 tokens,
    with the conditions above, the pacer's chunks on step costs modelled on the bench models'
    are the ones it took without this class.
    """

    GROWTH = 4
    SPAN = 2.0  # the steps' sizes must span this much for a fit
    # The steps fitted: those of the prompt's latest 256 tokens. A long prompt's later steps cost more per token
    # (longer context), and fitted over a whole prompt on a CPU that read as a floor.
    WINDOW_TOKENS = 256

    def __init__(self, small: int) -> None:
        self.small = small  # a chunk this small that still costs the whole target is the floor's sign (`first`)
        self._recent: deque[tuple[int, int, float]] = deque()  # (prompt tokens before it, tokens, seconds)
        self._done = 0  # the prompt's tokens prefilled beside streams since `reset`
        self._steps: dict[int, float] = {}  # the cheapest of the recent steps per chunk size
        self.floor: float | None = None  # the fitted cost of a step's prompt work at zero tokens, when it is large
        self._per_token = 0.0
        self._target = 0.0
        self._first_seen = False

    def reset(self) -> None:
        self._recent.clear()
        self._done = 0
        self._steps.clear()
        self.floor, self._first_seen = None, False

    def observe(self, tokens: int, seconds: float, target: float) -> None:
        """Learns from a lone prompt's step beside streams: `seconds` its prompt work took, `target` its budget."""
        done, self._done = self._done, self._done + tokens
        if not self._first_seen:  # a prompt's first step carries one-off costs (on the 0.5B CPU model, ~1.5x its rate)
            self._first_seen = True
            return
        self._recent.append((done, tokens, seconds))
        while self._recent[0][0] < done - self.WINDOW_TOKENS:
            self._recent.popleft()
        self._steps = {}  # the cheapest step of each size: a step is only ever slowed (a collection, a compile)
        for _, size, cost in self._recent:
            self._steps[size] = min(cost, self._steps.get(size, cost))
        fitted = _line(list(self._steps.items()), self.SPAN)
        if fitted is None:
            return
        floor, self._per_token = fitted
        self._target = target
        smallest = min(self._steps)
        # A small chunk (at most `first`) whose own work is under half the fitted floor: the floor sets its cost
        # (and the floor is no more than what that chunk's step cost: a line, not a stray intercept).
        starts = (smallest <= self.small and self._steps[smallest] >= target
                  and target / 2 <= floor <= 1.25 * self._steps[smallest] and self._per_token * smallest <= floor / 2)
        if starts or (self.floor is not None and floor >= target / 4):
            self.floor = floor
        else:
            self.floor = None

    def chunk(self, cap: int) -> int | None:
        """The next chunk while a floor is on (None: pace by cost per token)."""
        if self.floor is None:
            return None
        largest = max(self._steps)
        if self._per_token <= 0:
            return min(cap, self.GROWTH * largest)
        # The largest chunk that meets the target, or (the floor over half the target) one whose work equals the floor.
        sized = max(self._target - self.floor, self.floor) / self._per_token
        return max(1, round(min(cap, self.GROWTH * largest, sized)))


def _line(points: list[tuple[int, float]], span: float) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of seconds over tokens; None unless the tokens span `span`x."""
    xs = [x for x, _ in points]
    if len(points) < 2 or max(xs) < span * min(xs):
        return None
    return least_squares_line(xs, [y for _, y in points])


def least_squares_line(xs: list[int] | list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys); the xs must not all be equal."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope
