"""How many prompt positions a scoring slice takes (`PromptScoring`): scaled from the last slice of its kind.

Three kinds: a slice while nothing decodes (`IDLE`: as large as `--prefill-step-size` and the logits
cap allow, in passes of about `--max-stall-seconds`, so a request arriving meanwhile waits no longer
than it would behind a prefill's step), a slice riding in the streams' decode pass (`RIDING`,
`SideSlice`: its cost is what it adds to the step plus reading its rows), and a pass of its own
between two steps (`BETWEEN`: a model that cannot fuse). Beside streams a slice may cost `GAP_SHARE`
of the room `--max-gap-ratio` leaves past a decode step. Each size is the last one of its kind times
the room over its cost, not a cost per token: a slice's fixed cost (a read of every weight, the step's
Python) would make a rate learnt on small slices overshoot on large ones and the reverse, and a
position costs more the later it is in the prompt. At most twice the last: one fast slice on a noisy
machine must not size the next.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

LOGIT_BYTES = 64 << 20  # float32 logits of one slice's positions: the slice's rows are capped by the vocabulary
MIN_SLICE = 16
FIRST_SLICE = 64  # while streams decode and nothing has been measured yet
# Beside streams a slice is kept at this share of what `--max-gap-ratio` leaves past the decode step. On the ~85M
# CPU bench model a slice between steps varies +-40% in time at one size, and at 0.8 the worst gaps reached
# 3.05-3.36x (the prompt-scoring benchmark).
GAP_SHARE = 0.65
IDLE, RIDING, BETWEEN = "idle", "riding", "between"
# A riding slice's cost is what the decode steps carrying it took past a decode step. MLX evaluates a step's graph
# asynchronously and the next call waits for its tail (the output head over the slice's rows), so a step's time
# holds part of the previous slice: the rate per position is taken over the last `RIDING_WINDOW` steps, and a slice
# grows at most `RIDING_GROWTH` times the last. Sized from single steps at 0.65 of the room, with 2x growth, steps
# swung between 1.5 and 3.5 decode steps on the ~85M CPU bench model (worst gaps 3.0-3.6x).
RIDING_SHARE, RIDING_WINDOW, RIDING_GROWTH, RIDING_FIRST = 0.5, 4, 1.25, 32


@dataclass
class SliceBudget:
    max_gap_ratio: float = 3.0
    idle_tokens: int = 2048  # --prefill-step-size
    max_stall: float | None = None  # --max-stall-seconds
    last: dict[str, tuple[int, float]] = field(default_factory=dict)  # IDLE, BETWEEN -> latest (positions, seconds)
    # `RIDING`'s latest ones (`RIDING_WINDOW`), its rate taken over them
    riding: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RIDING_WINDOW))

    def observe(self, kind: str, positions: int, seconds: float) -> None:
        if positions > 0 and kind == RIDING:
            self.riding.append((positions, seconds))
        elif positions > 0:
            self.last[kind] = (positions, seconds)

    def size(self, kind: str, decode_seconds: float | None, vocab_size: int) -> int:
        """Positions for the next slice of this kind (`decode_seconds`: the streams' step, unless `IDLE`)."""
        rows = max(MIN_SLICE, LOGIT_BYTES // (4 * max(1, vocab_size)))
        last = self.last.get(kind)
        if kind == IDLE:
            cap = min(rows, self.idle_tokens)
            if last is None or not self.max_stall:
                return cap
            room = self.max_stall
        elif kind == RIDING:
            if not self.riding or decode_seconds is None:
                return min(rows, RIDING_FIRST)
            room = RIDING_SHARE * max(0.1, self.max_gap_ratio - 1.0) * decode_seconds
            rate = sum(cost for _, cost in self.riding) / sum(positions for positions, _ in self.riding)
            growth = RIDING_GROWTH * self.riding[-1][0] + MIN_SLICE
            return int(min(rows, growth, max(MIN_SLICE, room / max(rate, 1e-9))))
        else:
            if last is None or decode_seconds is None:
                return min(rows, FIRST_SLICE)
            cap, room = rows, GAP_SHARE * max(0.1, self.max_gap_ratio - 1.0) * decode_seconds
        positions, seconds = last
        return int(min(cap, 2 * positions, max(MIN_SLICE, positions * room / max(seconds, 1e-6))))
