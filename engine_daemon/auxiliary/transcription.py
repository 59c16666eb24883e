"""The transcription slot: Whisper through mlx-audio, run one 30-second window per slice.

Why mlx-audio's Whisper: it is already in the dependency tree (through mlx-vlm), loads MLX and
Hugging Face layouts from a local directory (`mlx_audio.stt.utils.load`, no download for a
path), and its `generate` returns what OpenAI's formats need: text, segments with start/end
seconds and decoding statistics, the (detected) language, and word timings from the alignment
heads. mlx-whisper has the same decoder but is not installed and brings nothing more.

Why windows: Whisper reads audio in 30-second windows; a long file decoded in one call would
hold the mlx thread for its whole length while chat streams wait. The job cuts the 16 kHz
samples into 30-second windows, and each window is decoded a slice per `step`: its encoder
pass in one, then about `budget` decoder tokens in each (`whisper_steps.SlicedWindow`: mlx-audio's
own `generate`, paused midway, so the result is exactly the unsliced call's), so the worker runs
chat steps between slices. Each window after the
first is prompted with the previous window's text (Whisper's `condition_on_previous_text`) and
the language found in the first window, so the windows read as one transcript; segment times
are shifted by the window's offset. A clip up to 30 s is exactly `model.generate`.
Sampling (the temperature fallback) uses a key sequence seeded per window, so a transcript is reproducible.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_daemon.auxiliary.jobs import AuxiliaryJob
from engine_daemon.auxiliary.model import register_loader
from engine_daemon.errors import RequestError

if TYPE_CHECKING:
    from engine_daemon.auxiliary.whisper_steps import SlicedWindow

log = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
WINDOW_SAMPLES = 30 * SAMPLE_RATE
# Whisper's default temperature schedule: 0 first, higher ones when a window's decode looks like a failure.
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
SEED = 0
_PROMPT_CHARS = 800  # previous text carried into the next window's prompt (Whisper keeps 223 tokens)


def _weight_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))


class TranscriptionModel:
    """A loaded Whisper (`AuxiliaryModel` of kind "transcription")."""

    kind = "transcription"

    def __init__(self, name: str, path: str):
        from mlx_audio.stt.utils import load

        self.name = name
        self.path = path
        self.model = load(path)
        if getattr(self.model, "_processor", None) is None:
            raise RequestError(400, "invalid_model", f"The Whisper model '{name}' has no tokenizer (WhisperProcessor "
                                                     "files) in its directory", param="model")
        self.weight_bytes = _weight_bytes(self.model)
        self.counts = {"windows": 0, "audio_seconds": 0}

    def job(self, args: dict[str, Any]) -> TranscriptionJob:
        return TranscriptionJob(self, args)

    def close(self) -> None:
        self.model = None


class TranscriptionJob(AuxiliaryJob):
    """One upload: its windows decoded in order, one per slice; segments streamed when asked."""

    kind = "transcription"

    def __init__(self, owner: TranscriptionModel, args: dict[str, Any]):
        self.owner = owner
        self.args = args
        self.audio = np.zeros(0, np.float32)
        self.offset = 0  # samples done
        self.language: str | None = args.get("language")
        self.texts: list[str] = []
        self.segments: list[dict[str, Any]] = []
        self._partials: list[dict[str, Any]] = []
        self._done = False
        self._window: SlicedWindow | None = None

    def prepare(self) -> None:
        """Off the mlx thread: the samples from the wire, the language code checked."""
        from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

        raw = self.args["audio"]
        self.audio = np.frombuffer(raw, dtype="<f4")  # a view of the CALL's bytes: one copy of the samples, not two
        if self.language is not None:
            code = self.language if self.language in LANGUAGES else TO_LANGUAGE_CODE.get(self.language)
            if code is None:
                raise RequestError(400, "invalid_value", f"Unknown language {self.language[:32]!r}: expected an "
                                                         "ISO-639-1 code Whisper knows, such as 'en'", param="language")
            self.language = code

    @property
    def held_bytes(self) -> int:
        return len(self.args.get("audio") or b"")

    def step(self, budget: int) -> bool:
        if self._done:
            return True
        model = self.owner.model
        if model is None:
            raise RequestError(503, "model_unloaded", "The transcription model was unloaded")
        if self._window is None:
            self._window = self._start_window(model)
        self.last_slice_tokens = self._window.step(budget)  # decoder tokens; an encoder-only slice counts 0
        if not self._window.done:
            return False
        output, self._window = self._window.output, None
        start = self.offset / SAMPLE_RATE
        self.language = self.language or output.language
        segments = [self._shift(segment, start) for segment in output.segments or ()]
        self.segments += segments
        self.texts.append(output.text)
        if self.args.get("stream"):
            self._partials.append({"delta": output.text, "segments": segments})
        self.offset += WINDOW_SAMPLES
        self.owner.counts["windows"] += 1
        self._done = self.offset >= self.audio.size
        if self._done:
            self.owner.counts["audio_seconds"] += int(round(self.audio.size / SAMPLE_RATE))
        return self._done

    def _start_window(self, model: Any) -> SlicedWindow:
        import mlx.core as mx

        from engine_daemon.auxiliary.whisper_steps import SlicedWindow

        window = self.audio[self.offset:self.offset + WINDOW_SAMPLES]
        temperature = self.args.get("temperature")
        prompt = self.args.get("prompt") if not self.texts else "".join(self.texts)[-_PROMPT_CHARS:]
        kwargs = dict(language=self.language, task=self.args.get("task") or "transcribe",
                      temperature=FALLBACK_TEMPERATURES if temperature is None else float(temperature),
                      initial_prompt=prompt or None, return_timestamps=bool(self.args.get("timestamps")),
                      word_timestamps=bool(self.args.get("word_timestamps")), verbose=None)
        return SlicedWindow(model, mx.array(window), kwargs, SEED)

    def close(self) -> None:
        """The job left the queue unfinished: its suspended window run is ended."""
        if self._window is not None:
            self._window.close()
            self._window = None

    def _shift(self, segment: dict[str, Any], start: float) -> dict[str, Any]:
        out = {key: _plain(value) for key, value in segment.items() if key != "words"}
        out["id"] = len(self.segments) + int(segment.get("id", 0))
        out["start"] = float(segment.get("start", 0.0)) + start
        out["end"] = float(segment.get("end", 0.0)) + start
        out["seek"] = int(segment.get("seek", 0)) + self.offset // 160  # mel frames, as Whisper counts seek
        if segment.get("words"):
            out["words"] = [{"word": str(w.get("word", "")), "start": float(w.get("start", 0.0)) + start,
                             "end": float(w.get("end", 0.0)) + start, "probability": _plain(w.get("probability"))}
                            for w in segment["words"]]
        return out

    def finished(self) -> bool:
        return self._done

    def partials(self) -> list[Any]:
        out, self._partials = self._partials, []
        return out

    def result(self) -> dict[str, Any]:
        from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

        language = self.language or "en"
        return {"model": self.owner.name, "text": "".join(self.texts), "language": language,
                "language_name": LANGUAGES.get(language, language), "duration": self.audio.size / SAMPLE_RATE,
                "segments": self.segments}


def _plain(value: Any) -> Any:
    """msgpack-safe: numpy / mlx scalars and lists of them as Python values."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (ValueError, TypeError):
            return value.tolist()
    return value


def load_transcription_model(name: str, path: str) -> TranscriptionModel:
    return TranscriptionModel(name, path)


def accepts(path: Path) -> bool:
    """A Whisper directory: config.json says whisper, in mlx-audio's (n_mels) or Hugging Face's layout."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (config.get("model_type") == "whisper" or "n_audio_ctx" in config)


load_transcription_model.accepts = accepts  # type: ignore[attr-defined]
register_loader("transcription", load_transcription_model)
