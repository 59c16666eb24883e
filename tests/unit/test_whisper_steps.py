"""The sliced Whisper window (engine_daemon.auxiliary.whisper_steps) is mlx-audio's `generate`, exactly.

A tiny random-weight Whisper from the builders; the reference is `model.generate` seeded as the
engine seeds. A budget of 2 tokens forces many pauses; chat-like work (other random draws and
MLX work) runs between slices, and must change nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlx_audio.stt.utils import load

    from model_builders.speech import build_whisper

    return load(str(build_whisper(Path(tmp_path_factory.mktemp("whisper")) / "tiny-whisper")))


def _audio(seconds: float) -> Any:
    rng = np.random.default_rng(3)
    t = np.arange(int(seconds * 16_000)) / 16_000
    return mx.array((0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(3 * t)) + 0.05 * rng.standard_normal(t.size))
                    .astype(np.float32))


def _reference(model: Any, audio: Any, kwargs: dict[str, Any]) -> Any:
    from engine_daemon.auxiliary.transcription import SEED

    mx.random.seed(SEED)
    return model.generate(audio, verbose=None, **kwargs)


def _sliced(model: Any, audio: Any, kwargs: dict[str, Any], budget: int) -> tuple[Any, int, list[int]]:
    from engine_daemon.auxiliary.transcription import SEED
    from engine_daemon.auxiliary.whisper_steps import SlicedWindow

    window = SlicedWindow(model, audio, {**kwargs, "verbose": None}, SEED)
    slices, tokens = 0, []
    while not window.done:
        tokens.append(window.step(budget))
        slices += 1
        mx.random.seed(12345)  # a chat step sampling between two slices
        mx.eval(mx.random.categorical(mx.zeros((4, 50))) + mx.ones(8).sum())
    assert "decode" not in vars(model)  # the instance's decode is only patched during a slice
    return window.output, slices, tokens


def _same(a: Any, b: Any) -> None:
    assert a.text == b.text and a.language == b.language
    assert len(a.segments) == len(b.segments)
    for x, y in zip(a.segments, b.segments):
        assert repr(x) == repr(y)  # repr: NaN log-probs (the tiny model's) compare equal, floats exactly


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0, "language": "en", "return_timestamps": True},
    {"temperature": 0.0, "language": "en", "return_timestamps": False, "initial_prompt": "hello there"},
    {"temperature": 0.0, "language": None, "return_timestamps": True, "word_timestamps": True},
    {"temperature": (0.0, 0.2, 0.4, 0.6, 0.8, 1.0), "language": "en", "return_timestamps": False},
    {"temperature": 0.7, "language": "en", "return_timestamps": True},
], ids=["greedy-timestamps", "greedy-prompt", "detect-words", "fallback", "sampled"])
def test_sliced_window_equals_generate(whisper: Any, kwargs: dict[str, Any]) -> None:
    audio = _audio(12.0)
    expected = _reference(whisper, audio, kwargs)
    for budget in (2,):
        got, slices, tokens = _sliced(whisper, audio, kwargs, budget)
        _same(got, expected)
        assert slices > 3  # log-mel, encoder pieces, then decoder slices
        assert max(tokens) <= budget and sum(tokens) > budget  # no slice ran more than its budget


def test_idle_budget_keeps_the_encoder_whole(whisper: Any) -> None:
    """Nothing decodes (the idle budget): one encoder slice, one decoder slice, the same transcript."""
    from engine_daemon.auxiliary.jobs import IDLE_BUDGET

    audio = _audio(12.0)
    kwargs = {"temperature": 0.0, "language": "en", "return_timestamps": False}
    got, slices, tokens = _sliced(whisper, audio, kwargs, IDLE_BUDGET)
    _same(got, _reference(whisper, audio, kwargs))
    assert slices == 2 and tokens[0] == 0 and tokens[1] > 0


def test_fallback_path_samples(whisper: Any) -> None:
    """The fallback case above is not vacuous: with the tiny model some window decodes at temperature > 0."""
    audio = _audio(12.0)
    out = _reference(whisper, audio, {"temperature": (0.0, 0.2, 0.4, 0.6, 0.8, 1.0), "language": "en"})
    assert any(segment["temperature"] > 0 for segment in out.segments)


def test_close_ends_a_suspended_window(whisper: Any) -> None:
    from engine_daemon.auxiliary.whisper_steps import SlicedWindow

    window = SlicedWindow(whisper, _audio(5.0), {"temperature": 0.0, "language": "en", "verbose": None}, 0)
    window.step(1)
    window.step(1)
    assert not window.done
    window.close()
    assert window.done and window.output is None and "decode" not in vars(whisper)
