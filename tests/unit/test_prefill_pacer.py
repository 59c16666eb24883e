"""The pacer sizes prompt chunks from measured costs (the per-step token budget)."""

from engine_daemon.scheduling.prefill_pacer import PrefillPacer


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
    assert pacer.chunk(1, 1) == 32
    pacer.observe(0.100, decoding=True, prompt_tokens=0)          # a decode step costs 100 ms
    pacer.observe(0.100 + 0.064, decoding=True, prompt_tokens=32)  # 32 prompt tokens added 64 ms
    assert pacer.chunk(1, 1) == 75  # 150 ms target at 2 ms per token
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
    assert pacer.chunk(decoding=4, prefilling=4) == 8     # as many streams as prompts: paced (unmeasured yet)
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
