"""The pacer sizes prompt chunks from measured costs."""

from engine_daemon.scheduling.prefill_pacer import PrefillPacer


def test_full_speed_when_nothing_decodes() -> None:
    assert PrefillPacer(None, maximum=2048).chunk(decoding=0, prefilling=1) == 2048


def test_fixed_chunk_while_decoding() -> None:
    assert PrefillPacer(64, maximum=2048).chunk(decoding=1, prefilling=1) == 64


def test_cautious_until_measured_then_explores() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.0, smoothing=1.0)
    assert pacer.chunk(1, 1) == 8
    pacer.observe(0.100, decoding=True, prompt_tokens=0)          # a decode step costs 100 ms
    pacer.observe(0.100 + 0.160, decoding=True, prompt_tokens=8)  # 8 prompt tokens added 160 ms
    assert pacer.chunk(1, 1) == 16  # one size seen: try twice as many to learn the line


def test_fits_fixed_and_per_token_cost() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, smoothing=1.0)
    pacer.observe(0.100, decoding=True, prompt_tokens=0)
    for tokens in (8, 16, 32):  # each chunk costs 50 ms + 2 ms per token
        pacer.observe(0.100 + 0.050 + 0.002 * tokens, decoding=True, prompt_tokens=tokens)
    assert pacer.chunk(1, 1) == 50   # (150 ms budget - 50 ms fixed) / 2 ms
    assert pacer.chunk(2, 2) == 25   # shared by two prompts
    assert pacer.chunk(0, 2) == 2048


def test_full_speed_while_more_prompts_wait_than_stream() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.0, smoothing=1.0)
    assert pacer.chunk(decoding=1, prefilling=7) == 2048  # a burst landed just after one request started
    assert pacer.chunk(decoding=4, prefilling=4) == 8     # as many streams as prompts: paced (unmeasured yet)
    assert PrefillPacer(64, maximum=2048).chunk(decoding=1, prefilling=7) == 64  # a fixed chunk is the operator's
