"""The pacer sizes prompt chunks from measured costs (the per-step token budget)."""

import random
import statistics

from engine_daemon.scheduling.prefill_pacer import BETWEEN_STEPS_IDLE, PrefillPacer, StepPeriods


def test_full_speed_when_nothing_decodes() -> None:
    assert PrefillPacer(None, maximum=2048).chunk(decoding=0, prefilling=1) == 2048


def test_fixed_chunk_while_decoding() -> None:
    assert PrefillPacer(64, maximum=2048).chunk(decoding=1, prefilling=1) == 64


def test_operator_budget_serves_decode_tokens_first() -> None:
    pacer = PrefillPacer(None, maximum=2048, budget=100)
    assert pacer.chunk(decoding=4, prefilling=1) == 96
    assert pacer.chunk(decoding=4, prefilling=2) == 48
    assert pacer.chunk(decoding=0, prefilling=1) == 2048  # nobody to protect


def test_first_chunk_until_measured_then_meets_the_target() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0, first=32)
    assert pacer.chunk(1, 1) == 0   # this many streams never ran a step alone: one decode-only step first
    pacer.observe(0.100, decoding=True, prompt_tokens=0)          # a decode step costs 100 ms
    assert pacer.chunk(1, 1) == 32  # no cost per token measured yet: the first chunk
    pacer.observe(0.100 + 0.064, decoding=True, prompt_tokens=32)  # 32 prompt tokens added 64 ms
    assert pacer.chunk(1, 1) == 75  # 150 ms target at 2 ms per token
    pacer.observe(0.100, decoding=2, prompt_tokens=0)  # two streams cost the same 100 ms
    assert pacer.chunk(2, 2) == 38  # shared by two prompts


def test_converges_despite_a_fixed_cost_per_step() -> None:
    """Each prefilling step costs 30 ms + 2 ms per token on top of decode: the chunk settles at 60."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0, first=8)
    pacer.observe(0.100, decoding=True, prompt_tokens=0)
    for _ in range(30):
        tokens = pacer.chunk(1, 1)
        pacer.observe(0.100 + 0.030 + 0.002 * tokens, decoding=True, prompt_tokens=tokens)
    assert 57 <= pacer.chunk(1, 1) <= 60


def test_later_chunks_shrink_as_the_prompt_grows_dearer() -> None:
    """Attention makes a token dearer the longer the context: the chunk follows the latest cost."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=2.0, smoothing=1.0)
    pacer.observe(0.050, decoding=True, prompt_tokens=0)
    pacer.observe(0.050 + 0.050, decoding=True, prompt_tokens=50)   # 1 ms per token early
    early = pacer.chunk(1, 1)
    pacer.observe(0.050 + 0.100, decoding=True, prompt_tokens=50)   # 2 ms per token later
    assert pacer.chunk(1, 1) == early // 2 == 50


def test_full_speed_while_more_prompts_wait_than_stream() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.0, smoothing=1.0, first=8)
    assert pacer.chunk(decoding=1, prefilling=7) == 2048  # a burst landed just after one request started
    assert pacer.chunk(decoding=4, prefilling=4) == 0     # as many streams as prompts: a decode-only step first
    assert PrefillPacer(64, maximum=2048).chunk(decoding=1, prefilling=7) == 64  # a fixed chunk is the operator's


def test_one_slow_decode_step_does_not_widen_the_target() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5)
    for seconds in (0.060, 0.062, 0.061, 0.300, 0.060):  # a collection pause among decode steps
        pacer.observe(seconds, decoding=True, prompt_tokens=0)
    assert abs(pacer.target_seconds() - 1.5 * 0.061) < 1e-9


def test_a_dearer_step_shrinks_the_next_chunk_at_once() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=0.1)
    pacer.observe(0.100, decoding=True, prompt_tokens=0)
    pacer.observe(0.100 + 0.050, decoding=True, prompt_tokens=50)   # 1 ms per token
    pacer.observe(0.100 + 0.150, decoding=True, prompt_tokens=50)   # 3 ms per token: believed at once
    assert pacer.chunk(1, 1) == 50


def test_the_target_follows_the_streams_running_now() -> None:
    """A decode step of one stream does not size chunks beside three (no decode-only step between)."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0)
    for _ in range(3):
        pacer.observe(0.020, decoding=1, prompt_tokens=0)
        pacer.observe(0.050, decoding=3, prompt_tokens=0)
    pacer.chunk(3, 1)
    assert abs(pacer.target_seconds() - 1.5 * 0.050) < 1e-9
    pacer.observe(0.050 + 0.050, decoding=3, prompt_tokens=25)  # 2 ms per token beside three streams
    assert pacer.chunk(3, 1) == 38
    pacer.chunk(2, 1)  # two streams never measured alone: the nearest count's cost (three, the dearer)
    assert abs(pacer.target_seconds() - 1.5 * 0.050) < 1e-9


def test_steps_of_several_prompts_do_not_teach_a_lone_prompts_rate() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0)
    pacer.observe(0.100, decoding=1, prompt_tokens=0)
    pacer.observe(0.100 + 0.050, decoding=1, prompt_tokens=50, prefilling=1)    # 1 ms per token alone
    pacer.observe(0.100 + 0.070, decoding=1, prompt_tokens=140, prefilling=7)   # 0.5 ms per token in a batch
    assert pacer.chunk(1, 1) == 150


def test_a_prompts_last_token_does_not_teach_a_rate() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0)
    pacer.observe(0.100, decoding=1, prompt_tokens=0)
    pacer.observe(0.100 + 0.050, decoding=1, prompt_tokens=50)   # 1 ms per token
    pacer.observe(0.100 + 0.040, decoding=1, prompt_tokens=1)    # the join step: not 40 ms per token
    assert pacer.chunk(1, 1) == 150


def test_a_burst_is_prefilled_in_steps_of_about_max_stall() -> None:
    """Full speed for a burst, but in steps a running stream can wait through (--max-stall-seconds)."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, max_stall=1.0, first_burst=256)
    assert pacer.chunk(decoding=1, prefilling=3) == 256  # nothing measured: a modest step that teaches the rate
    pacer.observe(2.0, decoding=0, prompt_tokens=1000)   # a lone prompt at full speed: 2 ms per token
    assert pacer.chunk(decoding=1, prefilling=3) == 167  # 1 s / 2 ms = 500 tokens, shared by three prompts
    assert pacer.chunk(decoding=0, prefilling=1) == 500  # nobody streams: the next arrival still waits a step
    pacer.observe(0.9, decoding=1, prompt_tokens=600, prefilling=3)  # 1.5 ms per token batched
    assert pacer.chunk(decoding=1, prefilling=3) == 190  # halfway to the newer rate (1.75 ms per token)
    pacer.observe(60.0, decoding=1, prompt_tokens=1000, prefilling=3)  # a very slow step: never below the floor
    assert pacer.chunk(decoding=1, prefilling=3) == 64


def test_without_max_stall_a_burst_takes_whole_chunks() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, max_stall=None)
    pacer.observe(2.0, decoding=0, prompt_tokens=1000)
    assert pacer.chunk(decoding=1, prefilling=3) == 2048


def test_one_slow_prefill_step_does_not_shrink_the_chunk() -> None:
    """A spike (a collection, a neighbour) among steady steps: the chunk stays; a lasting rise is followed."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0)
    pacer.observe(0.100, decoding=1, prompt_tokens=0)
    for seconds in (0.150, 0.150, 0.150, 0.400, 0.150):  # 1 ms per token, one step at 6 ms per token
        pacer.observe(seconds, decoding=1, prompt_tokens=50)
        assert pacer.chunk(1, 1) == 150
    pacer.observe(0.300, decoding=1, prompt_tokens=50)  # 4 ms per token, twice: the median follows
    pacer.observe(0.300, decoding=1, prompt_tokens=50)
    assert pacer.chunk(1, 1) == 38


def test_the_next_prompt_starts_from_the_first_chunk_again() -> None:
    """The last chunks of a long prompt are dear (long context); the next prompt does not inherit that."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0, first=32)
    pacer.observe(0.100, decoding=1, prompt_tokens=0)
    pacer.observe(0.100 + 0.150, decoding=1, prompt_tokens=10)  # 15 ms per token late in a prompt
    assert pacer.chunk(1, 1) == 10
    pacer.observe(0.100, decoding=1, prompt_tokens=0, prefilling=1)  # a step with prefill held: no reset
    assert pacer.chunk(1, 1) == 10
    pacer.observe(0.100, decoding=1, prompt_tokens=0, prefilling=0)  # nothing waits any more
    assert pacer.chunk(1, 1) == 32


def test_a_next_turn_gets_a_whole_full_speed_step() -> None:
    """`turn_chunk`: a conversation's next turn is not paced like a long prompt, but bounded like a burst."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, max_stall=1.0, first_burst=256)
    assert pacer.turn_chunk() == 256  # nothing measured yet
    pacer.observe(2.0, decoding=0, prompt_tokens=1000)  # 2 ms per token at full speed
    pacer.observe(0.035, decoding=2, prompt_tokens=0, prefilling=1)
    pacer.observe(0.035 + 16 * 0.003, decoding=2, prompt_tokens=16)  # paced: 3 ms per token beside two streams
    assert pacer.chunk(decoding=2, prefilling=1) < 40 < pacer.turn_chunk() == 500


def test_a_paced_chunk_fills_whole_row_tiles_with_the_streams() -> None:
    """Beside 4 streams a 40-token chunk is a 44-row pass: 44 tokens (48 rows) cost no more."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0, first=32, tile=16)
    pacer.observe(0.100, decoding=4, prompt_tokens=0)
    pacer.observe(0.100 + 0.064, decoding=4, prompt_tokens=32)  # 2 ms a token: 150 ms target -> 75 tokens
    assert pacer.chunk(4, 1) == 76  # 79 rows -> 80
    pacer.observe(0.100 + 0.150, decoding=4, prompt_tokens=40)  # dearer: 3.75 ms a token -> 40 tokens
    assert pacer.chunk(4, 1) == 44  # 44 rows -> 48
    assert pacer.chunk(4, 2) == 20  # two prompts share a pass: untiled
    # 36 rows -> 32, 41 rows -> 32 (a partial tile costs the whole one), 60 rows -> 64; 2 streams: 38 rows -> 32
    assert [pacer._tiled(n, 4, 1) for n in (32, 37, 56)] + [pacer._tiled(36, 2, 1)] == [28, 28, 60, 30]
    assert pacer._tiled(5, 4, 1) == 5  # never below the minimum


def test_a_step_period_includes_the_engine_work_since_the_previous_step() -> None:
    periods = StepPeriods()
    assert abs(periods.measure(10.000, 10.040) - 0.040) < 1e-9  # nothing before it: the step alone
    assert abs(periods.measure(10.045, 10.085) - 0.045) < 1e-9  # 5 ms of sending and admitting since the last
    idle = 10.085 + BETWEEN_STEPS_IDLE + 0.5  # the engine waited for work: that wait is nobody's gap
    assert abs(periods.measure(idle, idle + 0.040) - 0.040) < 1e-9


def test_a_prompts_first_steps_are_believed_as_they_come() -> None:
    """The first chunk's step looks dear per token (the pass's fixed cost): the second step's rate is taken at once."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=0.3, first=32)
    pacer.observe(0.100, decoding=4, prompt_tokens=0)
    pacer.observe(0.100 + 0.120, decoding=4, prompt_tokens=32)  # 3.75 ms a token: 150 ms buy 40
    assert pacer.chunk(4, 1) == 40
    pacer.observe(0.100 + 0.100, decoding=4, prompt_tokens=40)  # 2.5 ms a token: 60
    assert pacer.chunk(4, 1) == 60
    pacer.observe(0.100 + 0.120, decoding=4, prompt_tokens=60)  # 2 ms a token, but three rates now: their median
    assert pacer.chunk(4, 1) == 60
    pacer.observe(0.100 + 0.120, decoding=4, prompt_tokens=75)  # 1.6 ms: the median (2 ms) is grown to gently
    assert pacer.chunk(4, 1) == 64 and pacer._floor.floor is None


def _prefill(pacer: PrefillPacer, decode: float, cost, tokens: int = 1536, streams: int = 4) -> list[int]:
    """The chunks a `tokens`-long prompt is prefilled in beside `streams` when a step's prompt work costs `cost(c)`."""
    pacer.observe(decode, decoding=streams, prompt_tokens=0)
    chunks, done = [], 0
    while done < tokens:
        chunk = min(pacer.chunk(streams, 1), tokens - done)
        pacer.observe(decode + cost(chunk), decoding=streams, prompt_tokens=chunk)
        chunks.append(chunk)
        done += chunk
    return chunks


def test_a_step_cost_that_does_not_grow_with_tokens_grows_the_chunk() -> None:
    """A GPU's dispatch-bound step: 15 ms whatever the chunk, over a 12 ms target. Cut down, chunks never met it."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, first=32, max_stall=1.0)
    pacer.observe(0.030, decoding=0, prompt_tokens=1500)  # a prompt alone: 20 us per token at full speed
    chunks = _prefill(pacer, 0.008, lambda c: 0.015 + 0.00001 * c)
    assert len(chunks) <= 16, chunks  # cut towards the minimum it took 181 steps, each paying the 15 ms
    assert max(chunks) >= 512 and min(chunks[:3]) >= 16, chunks


def test_the_floor_stops_growing_where_the_prompts_work_equals_it() -> None:
    """A 10 ms floor over an 8 ms target, 0.1 ms a token: chunks settle at 100, the prompt's work equal to the floor."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.0, first=32, max_stall=1.0)
    pacer.observe(0.030, decoding=0, prompt_tokens=1500)
    chunks = _prefill(pacer, 0.008, lambda c: 0.010 + 0.0001 * c, tokens=4000)
    assert 95 <= statistics.median(chunks[-10:]) <= 105, chunks


def test_a_cost_per_token_never_looks_like_a_floor() -> None:
    """A CPU's compute-bound chunks (2 ms a token, +-20% from step to step): paced by the target throughout."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, first=32, max_stall=1.0)
    noise = iter([1.2, 0.8, 1.0, 1.2, 0.8, 1.2, 1.0, 0.8] * 20)
    chunks = _prefill(pacer, 0.100, lambda c: 0.002 * c * next(noise))
    assert max(chunks) <= 100 and pacer._floor.floor is None, chunks


def test_one_slow_step_is_not_a_floor() -> None:
    """A slow first step (twice its cost) halves the next chunk; the two do not fit a floor over the target."""
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0, first=32)
    pacer.observe(0.100, decoding=1, prompt_tokens=0)
    pacer.observe(0.100 + 0.320, decoding=1, prompt_tokens=32)  # 5 ms a token, but 10 this once
    assert pacer.chunk(1, 1) == 15
    pacer.observe(0.100 + 0.075, decoding=1, prompt_tokens=15)  # 5 ms a token
    assert pacer._floor.floor is None and pacer.chunk(1, 1) == 30


def test_a_long_prompts_dearer_later_chunks_are_not_a_floor() -> None:
    """On a CPU a token costs more the longer the context: small late chunks must not read as a floor.

    Fitted over a whole prompt, the late 28-token chunks (as dear as early 60-token ones) gave a
    floor, and the next chunk was 236 tokens: a 413 ms step beside 50 ms decode steps (~85M model).
    """
    for seed in range(6):
        noise = random.Random(seed)
        pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, first=32, max_stall=1.0, tile=16)
        pacer.observe(2.0, decoding=0, prompt_tokens=1536)
        done = [0]

        def cost(chunk: int) -> float:  # 0.9 ms a token at context 0, 2.5 ms at 1,536, +-20%
            seconds = (0.0009 + 0.0016 * done[0] / 1536) * chunk * noise.uniform(0.85, 1.25)
            done[0] += chunk
            return seconds

        for _ in range(3):  # prompt after prompt on one pacer, as in the engine
            done[0] = 0
            chunks = _prefill(pacer, 0.0475, cost)
            pacer.observe(0.0475, decoding=4, prompt_tokens=0, prefilling=0)
            assert max(chunks) <= 92, (seed, chunks)
