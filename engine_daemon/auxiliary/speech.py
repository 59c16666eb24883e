"""The speech slot: text-to-speech through mlx-audio, in slices of a segment or of a few tokens.

mlx-audio's TTS models share one interface: `mlx_audio.tts.utils.load(path)` and a `generate`
that yields a `GenerationResult` (float32 samples, sample rate) per segment of the input (a
line, or a sentence group, as the model splits it). The job keeps that generator and advances
it once per `step`, so the mlx thread returns to chat steps between segments, and hands each
segment's samples to the front-end at once as a partial RESULT (raw little-endian float32):
the HTTP response starts streaming with the first segment, not after the last. Soprano-style
models go finer (`speech_tokens`): a slice is at most 32 of their tokens, then a sentence's Vocos
decode runs in slices of at most 32 tokens (plus the decoder's context) and each is sent at once.

The front-end does everything else: encoding (mp3, opus, aac, flac, wav, pcm) and `speed`
(FFmpeg's atempo), so every model supports every format and speed alike. `voice` is passed to
the model as is (models without voices ignore it); `instructions` only to a model whose
`generate` takes them, else the request is refused rather than silently ignoring them. A
`--models-config` entry's `max_tokens` caps the tokens of each segment (models whose `generate`
takes `max_tokens`, such as Soprano, whose own cap is 512 tokens: 33 s of audio).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine_daemon.auxiliary.jobs import AuxiliaryJob
from engine_daemon.auxiliary.model import register_loader
from engine_daemon.auxiliary.speech_tokens import TOKENS_PER_SLICE, TokenSteps, supports
from engine_daemon.errors import RequestError

log = logging.getLogger(__name__)

_INSTRUCTION_PARAMS = ("instruct", "instructions")
SEED = 0
# mlx-audio architectures named like chat models (Orpheus is "llama", Qwen3 TTS variants "qwen3"): a chat
# checkpoint would pass for them, so a directory of those types is not taken as a speech model.
_AMBIGUOUS_TYPES = frozenset({"llama", "qwen3", "dense"})


class SpeechModel:
    """A loaded TTS model (`AuxiliaryModel` of kind "speech")."""

    kind = "speech"

    def __init__(self, name: str, path: str):
        from mlx.utils import tree_flatten
        from mlx_audio.tts.utils import load

        self.name = name
        self.path = path
        self.model = load(path)
        self.sample_rate = int(getattr(self.model, "sample_rate", 24_000))
        self.weight_bytes = sum(int(v.nbytes) for _, v in tree_flatten(self.model.parameters()))
        self.parameters = set(inspect.signature(self.model.generate).parameters)
        self.counts = {"segments": 0, "audio_seconds": 0}
        self.profile: Any = None  # its --models-config entry (set by the slots): `max_tokens` caps each segment

    def job(self, args: dict[str, Any]) -> SpeechJob:
        instructions = args.get("instructions")
        if instructions and not self.parameters & set(_INSTRUCTION_PARAMS):
            raise RequestError(400, "unsupported_parameter", f"The speech model '{self.name}' takes no "
                                                             "'instructions'", param="instructions")
        return SpeechJob(self, args)

    def close(self) -> None:
        self.model = None


class SpeechJob(AuxiliaryJob):
    """One `input`: the model's segments, one per slice, each sent on as it is made."""

    kind = "speech"

    def __init__(self, owner: SpeechModel, args: dict[str, Any]):
        self.owner = owner
        self.args = args
        self.samples = 0
        self._segments: Iterator[Any] | None = None
        self._steps: TokenSteps | None = None  # Soprano-style models: token-sized slices
        self._partials: list[dict[str, Any]] = []
        self._done = False

    def _start(self) -> Iterator[Any]:
        kwargs: dict[str, Any] = {"text": self.args["input"], "verbose": False}
        if self.args.get("voice") and "voice" in self.owner.parameters:
            kwargs["voice"] = self.args["voice"]
        for name in _INSTRUCTION_PARAMS:
            if self.args.get("instructions") and name in self.owner.parameters:
                kwargs[name] = self.args["instructions"]
        limit = getattr(self.owner.profile, "max_tokens", None)
        if limit and "max_tokens" in self.owner.parameters:
            kwargs["max_tokens"] = limit
        if "verbose" not in self.owner.parameters and "kwargs" not in self.owner.parameters:
            kwargs.pop("verbose")
        return iter(self.owner.model.generate(**kwargs))

    def step(self, budget: int) -> bool:
        if self._done:
            return True
        if self.owner.model is None:
            raise RequestError(503, "model_unloaded", "The speech model was unloaded")
        # Not the queue's tokens (embedding tokens): kept out of its per-token cost estimate.
        self.last_slice_tokens = 0
        if self._segments is None and self._steps is None:
            import mlx.core as mx

            mx.random.seed(SEED)  # the same input gives the same audio (models sample their tokens)
            if supports(self.owner.model):
                self._steps = TokenSteps(self.owner.model, self.args["input"],
                                         getattr(self.owner.profile, "max_tokens", None))
            else:
                self._segments = self._start()
        if self._steps is not None:
            if not self._steps.done():
                pcm = self._steps.advance(min(budget, TOKENS_PER_SLICE))
                # A decode slice's tokens (context included in their cost) size the next ones; the
                # language-model slices stay out of the estimate (their tokens are cheaper).
                self.last_slice_tokens = self._steps.decoded
                if pcm is not None:
                    self._send(pcm)
            if self._steps.done():
                return self._finish()
            return False
        try:
            segment = next(self._segments)
        except StopIteration:
            return self._finish()
        if int(getattr(segment, "sample_rate", 0) or self.owner.sample_rate) != self.owner.sample_rate:
            raise RequestError(500, "engine_error", "The speech model changed its sample rate mid-stream",
                               error_type="server_error")
        self._send(np.asarray(segment.audio, dtype=np.float32).reshape(-1))
        return False

    def _send(self, pcm: np.ndarray) -> None:
        self.samples += pcm.size
        self.owner.counts["segments"] += 1
        self._partials.append({"audio": pcm.astype("<f4", copy=False).tobytes(), "sample_rate": self.owner.sample_rate})

    def _finish(self) -> bool:
        self._done = True
        self.owner.counts["audio_seconds"] += int(round(self.samples / self.owner.sample_rate))
        return True

    def finished(self) -> bool:
        return self._done

    def partials(self) -> list[Any]:
        out, self._partials = self._partials, []
        return out

    def result(self) -> dict[str, Any]:
        return {"model": self.owner.name, "sample_rate": self.owner.sample_rate, "samples": self.samples}


def load_speech_model(name: str, path: str) -> SpeechModel:
    return SpeechModel(name, path)


def accepts(path: Path) -> bool:
    """A TTS directory: config.json names an architecture of mlx-audio's text-to-speech models."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    from mlx_audio.tts.utils import MODEL_REMAPPING, get_available_models

    model_type = str(config.get("model_type") or config.get("architecture") or "").lower()
    if not model_type or model_type in _AMBIGUOUS_TYPES:
        return False
    return model_type in MODEL_REMAPPING or model_type in get_available_models()


load_speech_model.accepts = accepts  # type: ignore[attr-defined]
register_loader("speech", load_speech_model)
