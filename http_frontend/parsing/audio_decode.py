"""Uploaded audio files -> 16 kHz mono float32 PCM, in the front-end and off its event loop.

Why here: the file is whatever the client sent (any container, any length, possibly hostile),
so decoding it is client-controlled CPU work that must never reach the engine's mlx thread.
The front-end decodes it with PyAV (FFmpeg's demuxers and decoders, bundled in the wheel: wav,
mp3, flac, ogg/opus/vorbis, m4a/mp4/aac, webm) in a small thread pool, so the event loop keeps
serving other requests meanwhile, and ships the engine raw little-endian float32 samples.

Bounds: the upload's size is checked by the route (25 MB, as OpenAI); here decoding stops as
soon as the audio passes `max_seconds`, so a tiny file that claims hours of silence costs no
more than `max_seconds` of samples. Only audio containers OpenAI lists are accepted: a video
with an audio track, an image or a text file is refused with a 400 naming the format, never
passed to a decoder it was not meant for.
"""

from __future__ import annotations

import asyncio
import io
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from http_frontend.errors import APIError, bad_request

log = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
# FFmpeg demuxer names of the containers OpenAI accepts (flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm).
ALLOWED_FORMATS = frozenset({"wav", "mp3", "flac", "ogg", "mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "aac",
                             "mpeg", "oga"})
# Two decodes at a time per worker: PyAV releases the GIL while FFmpeg decodes.
_DECODER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="audio-decode")


def decode_to_pcm(data: bytes, max_seconds: float) -> np.ndarray:
    """The first audio stream of `data` as float32 mono samples at 16 kHz; APIError 400 for bad input."""
    import av

    if not data:
        raise bad_request("The uploaded audio file is empty", param="file", code="empty_file")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The uploaded file is not audio in a supported format ({_reason(exc)}). Supported: "
                          "flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm", param="file",
                          code="invalid_audio") from None
    with container:
        name = container.format.name
        if name not in ALLOWED_FORMATS:
            raise bad_request(f"Unsupported audio container '{name}'. Supported: flac, mp3, mp4, mpeg, mpga, m4a, "
                              "ogg, wav, webm", param="file", code="unsupported_audio_format")
        if not container.streams.audio:
            raise bad_request("The uploaded file holds no audio stream", param="file", code="invalid_audio")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        limit = int(max_seconds * SAMPLE_RATE)
        parts: list[np.ndarray] = []
        total = 0
        try:
            for frame in container.decode(stream):
                frame.pts = None  # resample by sample count, whatever timestamps the file claims
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
                    total += parts[-1].size
                if total > limit:
                    raise bad_request(f"The audio is longer than {max_seconds:g} seconds, the limit of this "
                                      "server", param="file", code="audio_too_long")
            for out in resampler.resample(None):
                parts.append(out.to_ndarray().reshape(-1))
                total += parts[-1].size
        except av.error.FFmpegError as exc:
            raise bad_request(f"The uploaded audio file is corrupt ({_reason(exc)})", param="file",
                              code="invalid_audio") from None
    if total == 0:
        raise bad_request("The uploaded audio file holds no samples", param="file", code="invalid_audio")
    if total > limit:
        raise bad_request(f"The audio is longer than {max_seconds:g} seconds, the limit of this server",
                          param="file", code="audio_too_long")
    pcm = np.concatenate(parts).astype("<f4", copy=False)
    if not np.isfinite(pcm).all():
        raise bad_request("The uploaded audio holds non-finite samples (NaN or infinity); audio samples must be "
                          "finite numbers", param="file", code="invalid_audio")
    return pcm


def _reason(exc: Exception) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return text.split(":")[-1].strip() or type(exc).__name__


async def decode_upload(data: bytes, max_seconds: float) -> np.ndarray:
    """`decode_to_pcm` in the decoder pool, so the event loop serves other requests meanwhile."""
    try:
        return await asyncio.get_running_loop().run_in_executor(_DECODER, decode_to_pcm, data, max_seconds)
    except APIError:
        raise
    except (MemoryError, OSError) as exc:
        log.warning("decoding an upload failed: %s", exc)
        raise bad_request("The uploaded audio file could not be decoded", param="file", code="invalid_audio") from None
