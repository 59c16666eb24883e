"""The per-step token budget: how many prompt tokens a step may prefill while others decode.

Stall-free batching (Sarathi-Serve): every step first decodes one token for each
running stream, then spends what is left of a token budget on prompt chunks. The
budget is sized from measured step costs so that a step carrying prefill costs at
most `ratio` decode steps more than one without: running streams' inter-token
gaps stay within `1 + ratio` times their steady value (`--max-gap-ratio`), and
the waiting prompt gets the largest chunks that allows, so its first token is not
delayed more than the gap target forces. The target bounds the worst gap, so in
the engine a step is planned below it by how much dearer than planned this
machine's steps come out (`StepSpread`), and a chunk grows at most
`GROWTH_PER_STEP` times from one step to the next (a rate learnt from one noisy
step must not size a chunk several times the last). Where the newcomer's own TTFT target
(`--max-ttft-ratio`) leaves room, its steps are planned further under the gap target, where
the two are equally far off (`balanced_prefill_seconds`). When the chunk rides in the decode pass
(`StallFreeBatchGenerator`), a chunk of n tokens adds about `b*n` seconds to the
step; otherwise `a + b*n` (`a`: reading the weights once more). The pacer learns
that cost from the steps it has seen, so both cases, and a fast accelerator
(cheap prefill, large chunks), size themselves. The cost per prompt token also
grows as the prompt's own context grows (attention reads every earlier token), so
the pacer steers by the most recent steps' cost per token rather than a fit over
the whole prompt: a late chunk of a long prompt gets fewer tokens than an early one.
(Remembering the cost per stretch of context position, so that the next prompt
starts from what its first positions cost, was tried and measured worse: rates
learned from small chunks carry their step's fixed cost into other prompts.) Where
that cost is a floor rather than a rate (a GPU's dispatch-bound steps: a chunk of 512
tokens costs about what one of 32 does, both over the target), `CostFloor` sizes the
chunks instead of letting them shrink to the minimum.

On the CPU a fused step stops at every layer, so it can also hold its bound by the clock
(`step_deadline`, `LayerDeadline`): a chunk whose step runs late leaves the pass between two
layers and finishes in the next step (`LayerCarry`). The worst gap is then the bound rather than
the plan's tail, so with cuts a lone prompt's steps are planned at the bound for their mean cost
(`StepSpread.mean`, where the tail would need its 90th percentile), its chunks are sized past that
plan (`CUT_OVERSIZE`: the cut ends the step, the carry shrinks the next chunk) from its first step
on (the latest full-speed prefill's cost per token), and the TTFT balance stays out.

The operator can fix the budget instead (`--step-token-budget`: decode tokens
first, the rest to prefill) or fix the chunk (`--interleave-prefill-tokens`).

Pacing protects the streams that are running at the expense of the prompts that
wait, so (unless the operator fixed it) it only applies while the streams are at
least as many as the waiting prompts. When more clients wait for a first token
than are streaming (a burst of requests lands just after one started), the
waiting prompts are prefilled at full speed: a few streams slow down instead of
many clients waiting through dozens of paced steps. Full speed still comes in
steps of at most `max_stall` seconds (`--max-stall-seconds`, sized from the
measured cost per prompt token of full-speed steps), with a decode step between
them: three 1,240-token prompts landing beside one stream were one 11 s step on
the ~85M CPU model, an 11 s freeze of that stream; in ~1 s steps the stream keeps
moving and the prompts' first tokens come about as soon (smaller chunks also
skip more of the masked attention a one-pass prefill computes). The same bound holds
when nobody streams: a request that arrives waits for the step in flight, and an
agent's next turn (a few dozen tokens) waited 4.4 s behind another conversation's
one-step prefill.
"""

from __future__ import annotations

import statistics
from collections import deque

from engine_daemon.scheduling.cost_floor import CostFloor
from engine_daemon.scheduling.ttft_balance import AloneCosts, balanced_prefill_seconds

# Prompt tokens a step needs before its time per token says what full-speed prefill costs (fewer: the
# step's fixed cost dominates); also the smallest chunk a full-speed step gives each prompt.
FULL_SPEED_MINIMUM = 64
# `chunk`'s answer when this many streams have no decode-only step on record: prefill nothing this step.
SAMPLE_DECODE = 0
# Rows a BLAS or GPU matrix kernel computes at once: a product over 16k rows costs what one over 16k - 4 does
# (OpenBLAS's AVX-512 sgemm, ~85M bench model's MLP: 48 rows 3.43 ms, 44 rows 4.16 ms, 36 rows 3.50 ms). Measured
# on the CPU only; on a GPU a snap moves a chunk by less than one tile, little beside the hundreds of tokens a GPU
# step takes. A fused chunk shares its rows with the streams.
ROW_TILE = 16


# Engine time between two steps beyond which it is taken as idle, not as work the streams waited through.
BETWEEN_STEPS_IDLE = 0.025
# `StepSpread`: the quantile of steps' cost over their plan that a step is planned to leave room for, the steps it
# is taken over, how many it needs, and the most room it leaves (one neighbour's burst must not halve the chunks).
SPREAD_QUANTILE, SPREAD_WINDOW, SPREAD_SAMPLES, MOST_SPREAD = 0.9, 40, 8, 1.5
# With `StepSpread`, a lone prompt's paced chunk is at most this many times its previous one (or one tile more): a rate
# learnt from one or two noisy steps sized a 172-token third chunk after one of 76, a 3.5x step (~85M CPU model, 2-core
# VM), and growing 1.5x, a 140-token one after 92 on the 0.5B model (3.5x: a larger chunk costs more per token).
GROWTH_PER_STEP = 1.25
# `step_deadline`: the room a cut leaves under the gap target for what follows it in the step (the decode rows' last
# layers, sampling, sending the tokens), each as noisy as the rest of the step. It was 1.15 while a carry could grow
# to 200-300 rows whose last layers no cut could shorten (steps up to 60 ms past their bound on the ~85M CPU model);
# with a pass's rows capped (`PASS_ROWS`) the worst was 15 ms past it.
CUT_MARGIN = 1.10
# With a deadline, a lone prompt's chunk is this much larger than its step's plan: the step then ends at the bound
# whatever this step's pace, and no chunk ramps up a step at a time (each step of a ramp pays a decode step's weight
# read for a fraction of the prompt tokens it could carry).
CUT_OVERSIZE = 1.3


class StepPeriods:
    """What running streams wait between two tokens: a step plus the engine's own work since the previous one.

    The pacer's target is a multiple of the gap clients see, and between two generator steps the
    engine also sends the last step's tokens, takes new requests and publishes prefixes (~1-5 ms on
    the ~85M CPU model). Timing the generator call alone put the decode reference at 42.5 ms in one
    run where the streams' steady gap was 46 ms, and the fused steps sized from it at an effective
    2.35x where 2.5x was asked: the newcomer's chunks shrank and its first token came 27% later
    than in a run measured at 45.8 ms.
    """

    def __init__(self, idle: float = BETWEEN_STEPS_IDLE):
        self.idle = idle
        self._last_end: float | None = None

    def measure(self, started: float, ended: float) -> float:
        """The step's period: from the previous step's end (unless the engine idled since) to this one's."""
        between = None if self._last_end is None else started - self._last_end
        self._last_end = ended
        return ended - started + (between if between is not None and 0 <= between < self.idle else 0.0)


class StepSpread:
    """How much dearer than planned a step that prefills comes out on this machine: the room a gap target leaves.

    Why: the gap target bounds the streams' worst gap, not their median one, and the same
    fused step repeated costs more some times than others (~85M CPU model on a 2-core VM, in
    process: p50 163 ms, p90 210, max 233). Steps planned at the target's 2.5 decode steps
    there came out at 1.7-3.6: the chunk is sized from the latest steps' cost per token, which
    that noise also reaches. So the pacer records each lone prompt step's cost over its plan
    (the decode step plus the learnt rate times its tokens) and plans the next at the target
    divided by a high quantile of those (`SPREAD_QUANTILE` over the last `SPREAD_WINDOW`);
    until `SPREAD_SAMPLES` are on record, decode-only steps' own quantile over their median
    stands in. On a quiet machine the room is small and the chunks are as large as the target
    allows; on a noisy one they shrink so that a dear step still meets it.
    """

    def __init__(self) -> None:
        self._over_plan: deque[float] = deque(maxlen=SPREAD_WINDOW)

    def observe(self, seconds: float, planned: float) -> None:
        self._over_plan.append(seconds / planned)

    def factor(self, decode_steps: deque[float] | None) -> float:
        """The room a step's plan leaves under the target: at least 1, at most `MOST_SPREAD`."""
        if len(self._over_plan) >= SPREAD_SAMPLES:
            spread = _quantile(self._over_plan, SPREAD_QUANTILE)
        elif decode_steps is not None and len(decode_steps) >= SPREAD_SAMPLES:
            spread = _quantile(decode_steps, SPREAD_QUANTILE) / statistics.median(decode_steps)
        else:
            spread = 1.0
        return min(MOST_SPREAD, max(1.0, spread))

    def mean(self) -> float:
        """How much dearer than planned a step comes out on average (1 until `SPREAD_SAMPLES`): what a prompt's
        steps take in all, where `factor` bounds the worst of them."""
        if len(self._over_plan) < SPREAD_SAMPLES:
            return 1.0
        return min(MOST_SPREAD, max(1.0, statistics.fmean(self._over_plan)))


def _quantile(values: deque[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class PrefillPacer:
    def __init__(self, fixed: int | None, maximum: int, minimum: int = 8, ratio: float = 1.5,
                 smoothing: float = 0.3, budget: int | None = None, first: int = 32, window: int = 48,
                 max_stall: float | None = None, first_burst: int = 256, tile: int = 1, spread: bool = False,
                 ttft_ratio: float | None = None, cuts: bool = False):
        self.fixed = fixed
        self.cuts = cuts  # a lone prompt's chunk may leave its step's pass between layers (`step_deadline`)
        # With `spread`: a lone prompt's steps go under the gap target as far as its TTFT target allows
        # (`balanced_prefill_seconds`; the engine's `--max-ttft-ratio`, over a full-speed prefill).
        self.ttft_ratio = ttft_ratio
        # `StepSpread`: `ratio` bounds the worst step, not the planned one (the engine's; unit tests plan exactly).
        self.spread = StepSpread() if spread else None
        self.tile = tile  # `ROW_TILE` in the engine; 1 sizes chunks by time alone
        self.max_stall, self.first_burst = max_stall, first_burst
        self.budget = budget
        self.maximum = maximum
        self.minimum = minimum
        self.ratio = ratio
        self.smoothing = smoothing
        self.first = first
        self.window = window
        # Recent decode-only step times per number of streams: a step of 4 streams costs more than
        # one of 1, and the streams in a step change while a prompt is prefilled (no decode-only step
        # then to re-measure), so a single running median would size chunks from another batch.
        self._decode_steps: dict[int, deque[float]] = {}
        self._streams = 0  # streams decoding in the step being sized (set by `chunk`)
        self._prefilling = 0  # prompts prefilling in that step
        self.balanced = False  # the latest lone prompt's target is under the gap plan (`balanced_prefill_seconds`)
        # Seconds a prompt token added to the most recent steps that prefilled (smoothed). A
        # step's fixed cost makes a small chunk look dear per token; sizing the next chunk from
        # it still converges on the size whose whole cost meets the target (n' = T*n/(a+b*n)).
        self.seconds_per_token: float | None = None
        self._recent_rates: deque[float] = deque(maxlen=3)
        # Seconds per prompt token of recent full-speed steps (whole step over its prompt tokens): sizes
        # the burst steps that `max_stall` bounds.
        self.full_speed_seconds_per_token: float | None = None
        self.alone = AloneCosts()  # a lone prompt's full-speed steps by position: its TTFT target's reference
        self._paced_done = 0  # the lone prompt's tokens prefilled beside streams so far (its position in `alone`)
        self._floor = CostFloor(first)  # a prompt's step cost that does not grow with its tokens (a GPU's)
        self._last_chunk: int | None = None  # the lone prompt's latest paced chunk (`GROWTH_PER_STEP`)
        self.join_seconds: float | None = None  # what a step ending a prompt beside streams costs over its tokens

    @property
    def decode_seconds(self) -> float | None:
        """A decode-only step's cost for the streams running now (None until one was seen)."""
        return self.decode_seconds_for(self._streams)

    def decode_seconds_for(self, streams: int) -> float | None:
        """The median recent decode-only step with this many streams, else with the nearest count measured."""
        if not self._decode_steps:
            return None
        nearest = min(self._decode_steps, key=lambda count: (abs(count - streams), -count))
        return statistics.median(self._decode_steps[nearest])

    def target_seconds(self) -> float | None:
        """What prefill may add to a step: `ratio` decode steps (None until a decode step was seen).

        With `spread`, the whole step (decode and prefill) is planned at the target over the
        machine's `StepSpread`, so a step that comes out that much dearer still meets it.
        """
        return None if self.decode_seconds is None else self._target_for(self._streams)

    def describe_target(self) -> str:
        """The target for the engine's step trace: seconds, decode steps, and whether the TTFT balance set it."""
        target = self.target_seconds()
        if target is None:
            return "-"
        return f"{target * 1000:.0f} ms, {target / self.decode_seconds:.2f} decode steps" + (
            ", balanced" if self.balanced else "")

    def _target_for(self, streams: int, balanced: bool = True, cut: bool | None = None) -> float:
        """The target with `spread`; `balanced`: a lone prompt's, lowered where its TTFT target leaves room;
        `cut`: whether a late step is cut at its bound (None: whenever a lone prompt's can be)."""
        decode = self.decode_seconds_for(streams)
        if self.spread is None:
            return self.ratio * decode
        factor = self.spread.factor(self._decode_steps.get(streams))
        cut = self.cuts and self._prefilling == 1 if cut is None else cut
        if cut:  # a late step is cut at its bound: plan for the mean step there
            factor = self.spread.mean() * CUT_MARGIN
        least = self.ratio / (1 + self.ratio) * decode
        target = max(((1 + self.ratio) / factor - 1) * decode, least)
        self.balanced = self.balanced and not balanced
        # With a cut the bound holds the gap, so the newcomer gets the room (a paced token's cost relative to a
        # full-speed one is local to its position, and balanced by it the ~85M model's early chunks went slow).
        if balanced and not cut and self._prefilling == 1 and self.seconds_per_token is not None:
            paced = self.seconds_per_token * self.spread.mean()  # the plan's rate as steps come out on average
            even = balanced_prefill_seconds(decode, paced, self.alone.rate_at(self._paced_done), 1 + self.ratio,
                                            self.ttft_ratio, factor)
            self.balanced = even is not None and even < target
            if even is not None:
                target = max(least, min(target, even))
        return target

    def step_deadline(self) -> tuple[float, float] | None:
        """(bound, decode step) seconds for the step being sized: its chunk leaves the pass where the step would
        pass `bound` (`LayerDeadline`), the worst gap the target allows less `CUT_MARGIN`. None: no cut (the
        operator fixed the chunk or the budget, or the step is not a lone prompt's beside streams)."""
        decode = self.decode_seconds
        if not self.cuts or self.fixed or self.budget or self.spread is None or decode is None:
            return None
        if self._prefilling != 1 or not self._streams:
            return None
        return (1 + self.ratio) * decode / CUT_MARGIN, decode

    def chunk(self, decoding: int, prefilling: int) -> int:
        """Prompt tokens each of the `prefilling` requests may process in the next step, while `decoding` stream."""
        self._streams, self._prefilling = decoding, prefilling
        if not decoding:
            # Nobody to stall, but whoever arrives next (an agent's next turn) waits for the step in
            # flight: full speed in steps of about `max_stall` (4.4 s steps held next turns that long).
            return self._burst_chunk(prefilling)
        if self.fixed:
            return self.fixed  # the operator's --interleave-prefill-tokens
        if self.budget:  # the operator's --step-token-budget: decode tokens first, the rest to prefill
            return self._share(self.budget - decoding, prefilling)
        if decoding < prefilling:
            return self._burst_chunk(prefilling)  # more clients wait for a first token than stream: serve them first
        if decoding not in self._decode_steps:
            # These streams never ran a step without prefill: one such step first (`SAMPLE_DECODE`), or
            # the target would be a multiple of another count's step (a 1-stream warm-up sized chunks
            # beside three long streams at 8 tokens: every fused step then looked dear per token).
            return SAMPLE_DECODE
        cut = self.step_deadline() is not None
        # With cuts every step costs its bound whatever its chunk: `CostFloor` read that as a floor (a step that
        # did 32 tokens' work cost the target) and sized a 236-token chunk, a 552 ms step (~85M CPU model).
        floor_chunk = self._floor.chunk(min(self.maximum, self._burst_chunk(1))) if prefilling == 1 and not cut \
            else None
        if floor_chunk is not None:
            return self._tiled(max(self.minimum, floor_chunk), decoding, prefilling)
        target, rate = self.target_seconds(), self.seconds_per_token
        if rate is None and cut:
            rate = self.alone.rate_at(self._paced_done)  # full speed: dearer than a paced token; the cut bounds it
        if target is None or rate is None:
            return self._share(self.first, prefilling)
        tokens = target / rate
        if cut:  # the deadline ends the step at its bound, and what a cut leaves shrinks the next chunk
            return self._tiled(self._share(tokens * CUT_OVERSIZE, prefilling), decoding, prefilling)
        if self.spread is not None and self._last_chunk and prefilling == 1:
            # At least a tile more: a smaller step up would snap back to the same chunk (`_tiled`) for good.
            tokens = min(tokens, max(GROWTH_PER_STEP * self._last_chunk, self._last_chunk + self.tile))
        return self._tiled(self._share(tokens, prefilling), decoding, prefilling)

    def observe(self, step_seconds: float, decoding: int, prompt_tokens: int, prefilling: int = 1,
                ended: bool = False) -> None:
        """Learns from one finished step: its time, how many streams it decoded, how many prompt tokens
        it took for how many prompts; `ended`: a prompt ended in it beside the streams (`ending_chunk`)."""
        streams = int(decoding)
        if ended and streams and prefilling == 1 and self.seconds_per_token is not None:
            decode = self.decode_seconds_for(streams) or step_seconds
            extra = max(0.0, step_seconds - decode - self.seconds_per_token * prompt_tokens)
            self.join_seconds = _moved_toward(self.join_seconds, extra, 0.5)
            return  # the join's cost is not the tokens': learnt as a rate it would shrink the next prompt's chunks
        self.alone.observe(prompt_tokens, step_seconds, lone=not streams and prefilling == 1)
        if prompt_tokens >= FULL_SPEED_MINIMUM and streams < prefilling:  # a full-speed step
            self.full_speed_seconds_per_token = _moved_toward(self.full_speed_seconds_per_token,
                                                              step_seconds / prompt_tokens, 0.5)
        if prompt_tokens == 0:
            if not prefilling:
                # No prompt waits: the next one starts at context 0, where a token costs a fraction
                # of what the last chunks of a long prompt cost. Carried over, that rate started a
                # long prompt after a burst at 19-token chunks, regrown 30% a step.
                self.seconds_per_token = None
                self._recent_rates.clear()
                self._last_chunk = None
                self._floor.reset()
                self._paced_done = 0
            if streams:
                # The median of recent decode steps: one slow step (a collection, a neighbour's
                # burst) must not widen every gap that follows.
                self._decode_steps.setdefault(streams, deque(maxlen=self.window)).append(step_seconds)
            return
        if not streams:
            return  # a full-speed prefill says little about a chunk beside a decode step
        if prefilling == 1:
            self._paced_done += prompt_tokens
        if prompt_tokens < self.minimum:
            # A prompt's tail (its last token or few): the step's cost is the prompt joining the
            # streams, not tokens. Learnt as a rate it would read as tens of ms per token and start
            # the next prompt at the smallest chunk.
            return
        if prefilling != 1:
            # Several prompts in one step cost less per token (one weight read, one pass) than one
            # prompt does: learning from them would oversize the next lone prompt's chunk.
            return
        decode_seconds = self.decode_seconds_for(streams)
        if decode_seconds is None:
            return  # cannot tell the prefill's share of this step yet
        prompt_seconds = max(step_seconds - decode_seconds, 1e-6)
        if self.spread is not None and self.seconds_per_token is not None:
            self.spread.observe(step_seconds, decode_seconds + self.seconds_per_token * prompt_tokens)
        self._floor.observe(prompt_tokens, prompt_seconds, self._target_for(streams, balanced=False))
        self._recent_rates.append(prompt_seconds / prompt_tokens)
        self._last_chunk = prompt_tokens
        # The median of the last three steps' rates (the latest until there are three): one slow
        # step (a collection, a neighbour taking a core) says nothing about the next chunk's cost,
        # and believed at once it shrank the chunk for the several steps the gentle regrowth took;
        # after a burst of requests such spikes left a long prompt at ~60% of its chunk size.
        recent = self._recent_rates
        rate = statistics.median(recent) if len(recent) == recent.maxlen else recent[-1]
        if self.seconds_per_token is None or rate > self.seconds_per_token or len(recent) < recent.maxlen:
            # Dearer than thought: shrink the next chunk at once. And a prompt's first steps are believed
            # as they come: its first chunk (`first`, 32 tokens) carries the pass's fixed cost, and grown
            # gently from its rate, a 1,500-token prompt beside 4 streams on the 0.5B CPU model stayed at
            # 44-token chunks whose steps took 2.1-2.2 decode steps where 2.5 was asked (TTFT 14.3 s
            # against 11.5 s in the run whose second step already took 60).
            self.seconds_per_token = rate
        else:
            self.seconds_per_token = self._smooth(self.seconds_per_token, rate)  # cheaper: grow gently

    def ending_chunk(self) -> int | None:
        """The most tokens the step ending a lone prompt beside streams may take (None: any).

        That step also joins the prompt's KV to the streams' batch (118-193 ms, 0.4-0.6 decode steps, for
        1,500 tokens beside 4 streams on the 0.5B CPU model): it carries the target less that learnt cost.
        With cuts between layers it is the one step no cut can end (its last token's logits are due), so it is
        planned as steps without cuts are, under the target by the worst of the spread, and from the first
        prompt on (two trials' worst gaps, 3.3-3.6 decode steps, were ending steps sized like cut ones).
        """
        rate, cut = self.seconds_per_token, self.step_deadline() is not None
        if (self.join_seconds is None and not cut) or self.decode_seconds is None or not rate or self.fixed \
                or self.budget:
            return None
        target = self._target_for(self._streams, cut=False)
        return max(1, int((target - (self.join_seconds or 0.0)) / rate))

    def turn_chunk(self) -> int:
        """A conversation's next turn: the whole of it in one full-speed step (at most `max_stall` long).

        A next turn is short by definition (at most a few hundred new tokens after a long cached
        prefix), and its client waits on it with nothing else to read. Paced like a long prompt
        beside two streams it took 16-token chunks: three steps and a join for a 40-token turn.
        When the four conversations of the agent row fell into step, their next turns landed
        together and the last waited through the others' paced steps (~1.5 s on the ~85M CPU model).
        """
        return self._burst_chunk(1)

    def _burst_chunk(self, prefilling: int) -> int:
        """Each waiting prompt's chunk in a full-speed step that should last about `max_stall` seconds."""
        if not self.max_stall:
            return self.maximum
        rate = self.full_speed_seconds_per_token
        if rate is None:  # nothing measured yet: a modest step that teaches the rate
            return min(self.maximum, self.first_burst)
        per_prompt = self.max_stall / rate / max(1, prefilling)
        return round(max(min(self.maximum, FULL_SPEED_MINIMUM), min(self.maximum, per_prompt)))

    def _tiled(self, chunk: int, decoding: int, prefilling: int) -> int:
        """The chunk snapped to whole tiles (`ROW_TILE`) of its pass's rows (chunk + the streams').

        A pass over a part of a tile costs about what the whole tile costs: 44 rows (40 tokens
        beside 4 streams) cost more than 48 on the ~85M CPU model, and on the 0.5B one 65 tokens
        beside 4 streams (69 rows) took 529-557 ms where 60 (64 rows) took 420-490, the streams'
        worst gaps. So a chunk within a quarter tile of the next boundary grows to it, and any
        other drops to the boundary below: the time target then buys whole tiles, and the cost
        per token the pacer learns is not skewed by the rows a partial tile wastes.
        """
        if prefilling != 1 or self.tile <= 1:
            return chunk
        over = (chunk + decoding) % self.tile
        tiled = chunk + self.tile - over if over >= self.tile - self.tile // 4 else chunk - over
        return min(self.maximum, tiled) if tiled >= self.minimum else chunk

    def _smooth(self, old: float | None, new: float) -> float:
        return _moved_toward(old, new, self.smoothing)

    def _share(self, total: float, prefilling: int) -> int:
        return int(max(self.minimum, min(self.maximum, round(total / max(1, prefilling)))))


def _moved_toward(old: float | None, new: float, weight: float) -> float:
    """An exponential moving average's next value (`new` itself when there is no old one)."""
    return new if old is None else old + weight * (new - old)
