"""A transcription result from the engine in each of OpenAI's `response_format`s.

The engine returns one shape (text, language, duration, Whisper's segments with start/end
seconds, and words when asked); this module renders it as OpenAI does: ``json`` ({"text",
"usage"}), ``text`` (the bare text), ``srt`` and ``vtt`` (numbered cues from the segments) and
``verbose_json`` ({"task", "language", "duration", "text", "segments", "words"?, "usage"}).
Pure functions: no I/O, so they are unit-tested alone.
"""

from __future__ import annotations

import math
from typing import Any

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
# Segment fields OpenAI's verbose_json carries (the engine's extra fields are dropped).
_SEGMENT_FIELDS = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
                   "compression_ratio", "no_speech_prob")


def _clock(seconds: float, separator: str) -> str:
    """HH:MM:SS,mmm (SRT) or HH:MM:SS.mmm (WebVTT)."""
    millis = max(0, int(round(seconds * 1000)))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def _cues(result: dict[str, Any]) -> list[tuple[float, float, str]]:
    segments = result.get("segments") or []
    cues = [(float(s["start"]), float(s["end"]), str(s.get("text", "")).strip()) for s in segments]
    if not cues and result.get("text"):
        cues = [(0.0, float(result.get("duration") or 0.0), str(result["text"]).strip())]
    return cues


def to_srt(result: dict[str, Any]) -> str:
    return "".join(f"{i}\n{_clock(start, ',')} --> {_clock(end, ',')}\n{text}\n\n"
                   for i, (start, end, text) in enumerate(_cues(result), start=1))


def to_vtt(result: dict[str, Any]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(start, '.')} --> {_clock(end, '.')}\n{text}\n\n"
                                  for start, end, text in _cues(result))


def _number(value: Any) -> float:
    """NaN and infinities are not JSON: a random or degenerate model can produce them in log-probs."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def _segment(segment: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _SEGMENT_FIELDS:
        value = segment.get(name)
        if name in ("id", "seek"):
            out[name] = int(value or 0)
        elif name == "text":
            out[name] = str(value or "")
        elif name == "tokens":
            out[name] = [int(t) for t in (value or ())]
        else:
            out[name] = _number(value)
    return out


def usage(result: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's duration-based usage of a Whisper transcription (whole seconds, rounded up)."""
    return {"type": "duration", "seconds": int(math.ceil(_number(result.get("duration"))))}


def render(result: dict[str, Any], response_format: str, task: str, words: bool = False) -> tuple[Any, str]:
    """(body, media type): a dict for the JSON formats, a str for text / srt / vtt."""
    if response_format == "text":
        return str(result.get("text", "")), "text/plain; charset=utf-8"
    if response_format == "srt":
        return to_srt(result), "text/plain; charset=utf-8"
    if response_format == "vtt":
        return to_vtt(result), "text/vtt; charset=utf-8"
    if response_format == "verbose_json":
        body: dict[str, Any] = {"task": task, "language": result.get("language_name") or result.get("language"),
                                "duration": _number(result.get("duration")), "text": str(result.get("text", "")),
                                "segments": [_segment(s) for s in result.get("segments") or ()]}
        if words:
            body["words"] = [{"word": str(w.get("word", "")), "start": _number(w.get("start")),
                              "end": _number(w.get("end"))}
                             for s in result.get("segments") or () for w in s.get("words") or ()]
        body["usage"] = usage(result)
        return body, "application/json"
    return {"text": str(result.get("text", "")), "usage": usage(result)}, "application/json"
