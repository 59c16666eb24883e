"""Speech PCM from the engine -> the bytes of the file format a client asked for, chunk by chunk.

Why in the front-end: encoding is CPU work per byte of output that needs no model, so it runs
next to the HTTP connection (in a small thread pool, off the event loop) and the engine only
ships raw float32 samples. Why incremental: `/v1/audio/speech` streams its body with chunked
transfer as the engine synthesizes, so each encoder takes PCM in pieces and returns whatever
bytes are ready (a file header first, then frames), never needing the whole clip.

Formats (OpenAI's `response_format`): ``mp3`` (LAME), ``opus`` (Ogg Opus, 48 kHz), ``aac``
(ADTS), ``flac``, ``wav`` (16-bit PCM) and ``pcm`` (raw signed 16-bit little-endian mono, at the
model's sample rate, OpenAI documents 24 kHz for its own voices). A streamed WAV cannot know its
length up front, so its RIFF and data sizes say 0xFFFFFFFF ("until the end"), as FFmpeg and
OpenAI's streamed WAVs do; a streamed FLAC's STREAMINFO leaves the total sample count unknown.

`speed` (0.25 to 4.0) is applied here with FFmpeg's `atempo` filter (tempo without pitch change),
so every speech model honours it whether or not it has a speed control of its own.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

# format -> (FFmpeg muxer, encoder, sample rate or None for the model's own, media type)
FORMATS: dict[str, tuple[str | None, str | None, int | None, str]] = {
    "mp3": ("mp3", "libmp3lame", None, "audio/mpeg"),
    "opus": ("ogg", "libopus", 48_000, "audio/ogg"),
    "aac": ("adts", "aac", None, "audio/aac"),
    "flac": ("flac", "flac", None, "audio/flac"),
    "wav": (None, None, None, "audio/wav"),
    "pcm": (None, None, None, "audio/pcm"),
}
MIN_SPEED, MAX_SPEED = 0.25, 4.0
# Sample rates LAME and AAC take; anything else is resampled to the nearest one at or above it.
_MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


def media_type(fmt: str) -> str:
    return FORMATS[fmt][3]


def _to_int16(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class _Sink:
    """A write-only file for PyAV's muxer: what it writes is collected until taken."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class _Tempo:
    """FFmpeg's atempo as a streaming filter (float32 mono in and out)."""

    def __init__(self, rate: int, speed: float):
        import av.filter

        self.graph = av.filter.Graph()
        src = self.graph.add_abuffer(format="flt", sample_rate=rate, layout="mono", time_base=f"1/{rate}")
        node = src
        remaining = speed
        while remaining < 0.5 or remaining > 2.0:  # each atempo stage is kept inside 0.5..2 for quality
            step = 0.5 if remaining < 0.5 else 2.0
            stage = self.graph.add("atempo", str(step))
            node.link_to(stage)
            node, remaining = stage, remaining / step
        stage = self.graph.add("atempo", f"{remaining:.6f}")
        node.link_to(stage)
        sink = self.graph.add("abuffersink")
        stage.link_to(sink)
        self.graph.configure()
        self.rate = rate
        self.pts = 0

    def process(self, pcm: np.ndarray | None) -> np.ndarray:
        import av

        if pcm is not None and pcm.size:
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.float32)[None, :], format="flt",
                                               layout="mono")
            frame.sample_rate = self.rate
            frame.pts = self.pts
            self.pts += pcm.size
            self.graph.push(frame)
        elif pcm is None:
            self.graph.push(None)
        out: list[np.ndarray] = []
        while True:
            try:
                frame = self.graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1).astype(np.float32))
        return np.concatenate(out) if out else np.zeros(0, np.float32)


class StreamingEncoder:
    """Float32 mono PCM in, encoded bytes out: `feed(pcm)` as chunks arrive, then `finish()`."""

    def __init__(self, fmt: str, sample_rate: int, speed: float = 1.0):
        if fmt not in FORMATS:
            raise ValueError(f"unknown audio format {fmt!r}")
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.tempo = _Tempo(sample_rate, speed) if abs(speed - 1.0) > 1e-6 else None
        self.samples = 0  # samples encoded (after the tempo change)
        self._header_sent = False
        muxer, codec, rate, _ = FORMATS[fmt]
        self._container = None
        if muxer is not None:
            import av

            out_rate = rate or sample_rate
            if codec in ("libmp3lame", "aac") and out_rate not in _MP3_RATES:
                out_rate = next((r for r in _MP3_RATES if r >= out_rate), 48_000)
            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=muxer)
            self._stream = self._container.add_stream(codec, rate=out_rate)
            self._stream.layout = "mono"
            formats = [f.name for f in (self._stream.codec_context.codec.audio_formats or ())]
            encoder_format = "s16" if "s16" in formats else (formats[0] if formats else "fltp")
            self._stream.codec_context.format = encoder_format
            self._resampler = av.AudioResampler(format=encoder_format, layout="mono", rate=out_rate)

    def feed(self, pcm: np.ndarray) -> bytes:
        """Encodes another piece of the clip; returns the bytes ready so far (maybe none)."""
        if self.tempo is not None:
            pcm = self.tempo.process(pcm)
        return self._encode(pcm)

    def finish(self) -> bytes:
        """Flushes the tempo filter, the encoder and the muxer; returns the last bytes."""
        tail = self.tempo.process(None) if self.tempo is not None else np.zeros(0, np.float32)
        out = self._encode(tail)
        if self._container is None:
            return out + (self._wav_header() if self.fmt == "wav" and not self._header_sent else b"")
        for frame in self._resampler.resample(None):
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return out + self._sink.take()

    def _encode(self, pcm: np.ndarray) -> bytes:
        self.samples += int(pcm.size)
        if self._container is None:
            body = _to_int16(pcm) if pcm.size else b""
            if self.fmt == "wav" and not self._header_sent:
                self._header_sent = True
                return self._wav_header() + body
            return body
        if pcm.size:
            import av

            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.float32)[None, :], format="flt",
                                               layout="mono")
            frame.sample_rate = self.sample_rate
            for resampled in self._resampler.resample(frame):
                for packet in self._stream.encode(resampled):
                    self._container.mux(packet)
        return self._sink.take()

    def _wav_header(self) -> bytes:
        """A RIFF/WAVE header for 16-bit mono PCM of unknown length (sizes 0xFFFFFFFF)."""
        unknown = 0xFFFFFFFF
        return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
                + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, self.sample_rate, self.sample_rate * 2, 2, 16)
                + b"data" + struct.pack("<I", unknown))


def encode_all(pcm: np.ndarray, fmt: str, sample_rate: int, speed: float = 1.0) -> bytes:
    """A whole clip in one call (tests, small clips)."""
    encoder = StreamingEncoder(fmt, sample_rate, speed)
    return encoder.feed(pcm) + encoder.finish()
