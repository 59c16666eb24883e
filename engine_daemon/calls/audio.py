"""Audio CALLs checked on the io thread: each becomes an `AuxiliaryRequest` for the mlx thread.

Only shape checks happen here, on what a hand-made frame could carry: the samples are bytes of
whole float32 values within the length the front-end allows, the text fields are short strings
of the expected kinds. Decoding the upload happened in the front-end; turning the bytes into
an array is the job's `prepare`, on the admission pool.
"""

from __future__ import annotations

from typing import Any

from engine_daemon.auxiliary.jobs import AuxiliaryRequest
from engine_daemon.calls.auxiliary import _model_name
from engine_daemon.errors import RequestError

SAMPLE_RATE = 16_000
# The front-end's ceiling (--max-audio-seconds at most 520 s) with room to spare; the frame limit is lower anyway.
MAX_AUDIO_SECONDS = 600
MAX_PROMPT_CHARS = 64 * 1024
MAX_SPEECH_CHARS = 64 * 1024
TASKS = ("transcribe", "translate")


def _optional_str(args: dict[str, Any], name: str, limit: int) -> str | None:
    value = args.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise RequestError(400, "invalid_value", f"'{name}' must be a string of at most {limit} characters",
                           param=name)
    return value


def transcribe(ctx: Any, args: dict[str, Any]) -> AuxiliaryRequest:
    """{"audio": float32 bytes, "task", "language", "prompt", "temperature", ...} -> a transcription job."""
    audio = args.get("audio")
    if not isinstance(audio, bytes) or not audio or len(audio) % 4:
        raise RequestError(400, "invalid_audio", "'audio' must be non-empty float32 samples", param="file")
    if len(audio) > MAX_AUDIO_SECONDS * SAMPLE_RATE * 4:
        raise RequestError(400, "audio_too_long", f"The audio is longer than {MAX_AUDIO_SECONDS} s", param="file")
    task = args.get("task") or "transcribe"
    if task not in TASKS:
        raise RequestError(400, "invalid_value", "'task' must be transcribe or translate", param="task")
    temperature = args.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not 0 <= temperature <= 1):
        raise RequestError(400, "invalid_value", "'temperature' must be between 0 and 1", param="temperature")
    job_args = {"audio": audio, "task": task, "language": _optional_str(args, "language", 32),
                "prompt": _optional_str(args, "prompt", MAX_PROMPT_CHARS), "temperature": temperature,
                "timestamps": bool(args.get("timestamps")), "word_timestamps": bool(args.get("word_timestamps")),
                "stream": bool(args.get("stream"))}
    return AuxiliaryRequest("transcription", _model_name(args), job_args)


def speech(ctx: Any, args: dict[str, Any]) -> AuxiliaryRequest:
    """{"input", "voice", "instructions"} -> a speech job."""
    text = args.get("input")
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_SPEECH_CHARS:
        raise RequestError(400, "invalid_value", f"'input' must be non-empty text of at most {MAX_SPEECH_CHARS} "
                                                 "characters", param="input")
    job_args = {"input": text, "voice": _optional_str(args, "voice", 256),
                "instructions": _optional_str(args, "instructions", MAX_PROMPT_CHARS)}
    return AuxiliaryRequest("speech", _model_name(args), job_args)
