"""How far under the gap target a lone prompt's steps may be planned, given what its first token may wait.

Why: the pacer serves two targets at once. Running streams' worst gap stays within
`--max-gap-ratio` decode steps, and the newcomer's first token comes within `--max-ttft-ratio`
times what it would take at full speed. Planning every step at the gap target spends all of
the newcomer's slack on speed it does not need, and leaves the streams none for a noisy step:
on the 0.5B CPU bench model (2-core VM) the newcomer's TTFT was 1.02-1.09x alone, with 0.5x to
spare, while single steps planned at 2.7 decode steps came out at 3.06-3.36x (a neighbour, a
collection, a longer context than the rate was learnt at). There a paced token costs about half
of a full-speed one: the streams' step reads the weights anyway, where a full-speed step of
about one second carries ~100 tokens and pays that read itself.

The model: with `t` seconds of prefill added to a decode step of `D`, the step costs `D + t` and
carries `t / rate` tokens, so a paced token costs `rate * (D + t) / t` against `full_speed`
alone, a TTFT ratio of `k * (1 + D / t)` with `k = rate / full_speed`; the streams' worst step is
about `spread * (D + t)` against `gap * D`. The first falls as `t` grows and the second rises;
they are equally far under their targets at `t = k * (gap / ttft) * D / spread`. Below the gap
plan, that `t` meets both with the same margin; above it, the gap plan is the one to keep (the
operator's `--max-gap-ratio` is the streams' guarantee, and the newcomer then gets all the room
it leaves). Where a paced token costs what a full-speed one does (`k` near 1: the ~85M CPU model,
whose full-speed steps carry ~450 tokens per read of the weights), the balance lies above the gap
plan and nothing changes.
"""

from __future__ import annotations


def balanced_prefill_seconds(decode: float, rate: float, full_speed_rate: float | None, gap_ratio: float,
                             ttft_ratio: float | None, spread: float) -> float | None:
    """Prefill seconds per step at which the gap and TTFT targets are equally far off (None: nothing to weigh).

    `decode`: the streams' decode step; `rate`: seconds a paced prompt token adds to a step, as
    steps come out on average (the plan's rate times `StepSpread.mean`: planned at the rate alone,
    the ~85M CPU model's steps, 1.2-1.4x dearer than planned at the 90th percentile on a noisy
    2-core VM, read a paced token at 0.74 of a full-speed one where the prompt's steps took 1.07,
    and its TTFT came 1.55-1.98x alone against 1.25-1.80x at the gap plan);
    `full_speed_rate`: seconds per prompt token of a full-speed step (its whole cost); `gap_ratio`:
    the worst gap's target in decode steps; `ttft_ratio`: the newcomer's TTFT target over full
    speed; `spread`: how much dearer than planned steps come out (`StepSpread.factor`).
    """
    if not ttft_ratio or not full_speed_rate or rate <= 0 or decode <= 0:
        return None
    return (rate / full_speed_rate) * (gap_ratio / ttft_ratio) * decode / max(1.0, spread)


# A lone full-speed prefill shorter than this says little about what a long prompt's tokens cost alone.
PROFILE_TOKENS = 256


class AloneCosts:
    """What a prompt's tokens cost at full speed with nobody streaming, by position in the prompt: its TTFT's reference.

    Why by position: a token's cost grows with the context before it (attention reads it), so the
    paced rate of a prompt's early chunks set against the average of a whole prompt prefilled
    alone reads as cheap, and steps were planned under the gap plan early in the prompt and at it
    late, where the newcomer's TTFT needed them (in modelled ~85M CPU steps, context 1.8x dearer at
    the end: TTFT 1.57-1.77x alone at the gap plan, 1.62-1.77x so balanced). Kept: the latest
    lone full-speed prefill of at least `PROFILE_TOKENS`, as (end position, seconds per token) a step.
    """

    def __init__(self) -> None:
        self._run: list[tuple[int, float]] = []  # the lone prefill going on
        self._profile: list[tuple[int, float]] = []

    def observe(self, tokens: int, seconds: float, lone: bool) -> None:
        """A step: `lone` when it prefilled `tokens` of one prompt at full speed with nobody streaming."""
        if lone and tokens > 0:
            start = self._run[-1][0] if self._run else 0
            self._run.append((start + tokens, seconds / tokens))
        elif self._run:
            if self._run[-1][0] >= PROFILE_TOKENS:
                self._profile = self._run
            self._run = []

    def rate_at(self, position: int) -> float | None:
        """Seconds per token alone at this position of a prompt (the profile's last step's past its end)."""
        for end, rate in self._profile:
            if position < end:
                return rate
        return self._profile[-1][1] if self._profile else None
