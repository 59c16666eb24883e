"""A sentence's Vocos decode in bounded slices gives the one-call decode's samples (issue #19).

Real mlx-audio Soprano decoder (random weights through the real loader). Each slice decodes at
most its budget of tokens plus `receptive_field` tokens of context on each side, and the samples
kept equal the one-call decode (plus Soprano generate's trim) to float32 rounding: bit-identical
on an Intel CI machine, up to 1.4e-7 apart on an AMD EPYC one. So the bound is 1e-6 absolute.
Measured on the AMD machine, largest difference by context: 4 tokens (the config's) 1.4e-7;
3 (what the decoder's convolutions and ISTFT reach) 1.4e-7; 2: 3.3e-5; 1: 0.11. A slice with
less context than the decoder reaches therefore fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine_daemon.auxiliary.speech_tokens import MIN_DECODE_TOKENS, ChunkedDecode


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlx_audio.tts.utils import load

    from model_builders.speech import build_tts

    return load(str(build_tts(tmp_path_factory.mktemp("tts"))))


class _Counting:
    """Wraps the decoder to record how many hidden states each call decodes."""

    def __init__(self, decoder: Any):
        self.decoder, self.calls = decoder, []

    def __call__(self, x: Any) -> Any:
        self.calls.append(x.shape[1])
        return self.decoder(x)


def _one_call(model: Any, hidden: list[Any]) -> np.ndarray:
    import mlx.core as mx

    audio = model.decoder(mx.concatenate(hidden, axis=1))
    size = model.config.decoder_config.token_size
    length = len(hidden) * size - size
    return np.asarray(audio[0, -length:] if length > 0 else audio[0], dtype=np.float32)


@pytest.mark.parametrize(("tokens", "budget"), [(3, 32), (37, 8), (100, 32), (64, 16)])
def test_sliced_decode_equals_one_call(model: Any, tokens: int, budget: int) -> None:
    import mlx.core as mx

    mx.random.seed(tokens)
    channels = model.decoder.decoder_initial_channels
    hidden = [mx.random.normal((1, 1, channels)) for _ in range(tokens)]
    whole = _one_call(model, hidden)
    original = model.decoder
    model.decoder = counting = _Counting(original)
    try:
        decode = ChunkedDecode(model, hidden)
        parts = []
        while not decode.done():
            parts.append(decode.next(budget))
    finally:
        model.decoder = original
    sliced = np.concatenate(parts)
    assert sliced.shape == whole.shape
    assert np.abs(sliced - whole).max() <= 1e-6  # float32 rounding (module docstring); 2 tokens of context: 3.3e-5
    context = model.config.decoder_config.receptive_field
    step = max(MIN_DECODE_TOKENS, budget)
    assert len(counting.calls) == -(-tokens // step)
    assert max(counting.calls) <= step + 2 * context  # each slice bounded: its tokens plus the context
