"""The pacer sizes prompt chunks from measured costs."""

from engine_daemon.prefill_pacer import PrefillPacer


def test_full_speed_when_nothing_decodes() -> None:
    assert PrefillPacer(None, maximum=2048).chunk(decoding=False, prefilling=1) == 2048


def test_fixed_chunk_while_decoding() -> None:
    assert PrefillPacer(64, maximum=2048).chunk(decoding=True, prefilling=1) == 64


def test_chunk_costs_about_one_decode_step() -> None:
    pacer = PrefillPacer(None, maximum=2048, minimum=8, smoothing=1.0)
    assert pacer.chunk(True, 1) == 8  # nothing measured yet: cautious
    pacer.observe(0.100, decoding=True, prompt_tokens=0)       # a decode step costs 100 ms
    pacer.observe(0.100 + 0.080, decoding=True, prompt_tokens=8)  # 8 prompt tokens cost 80 ms
    assert pacer.chunk(True, 1) == 10   # 100 ms of prefill at 10 ms per token
    assert pacer.chunk(True, 2) == 8    # shared by two prompts, floored at the minimum
    pacer.observe(0.5, decoding=False, prompt_tokens=500)       # a fast accelerator: 1 ms per token
    assert pacer.chunk(True, 1) == 100
