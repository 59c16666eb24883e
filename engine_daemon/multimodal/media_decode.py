"""A request's images and audio, decoded with bounds, on the admission pool rather than the mlx thread.

Decoding is client-controlled work: 16 copies of a 6 KB 7071x7071 PNG held the mlx thread
for 27 s (6 GB), and a 10 MB 8-bit WAV of 2.8 hours for 41 s (2.2 GB), while every stream
stood still. So `decode_media` runs where prompts are rendered (`Preprocessor`, given it by
`EngineServer`), and before a pixel or a sample is decoded, a request's images are held to
MAX_REQUEST_PIXELS in all and each clip is measured: PyAV counts its samples (stopping past
MAX_AUDIO_SECONDS for the request) and its container must be the format it claims. A clip
with no samples or with non-finite ones is a 400, as on /v1/audio/transcriptions.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from engine_daemon.errors import RequestError, describe
from engine_daemon.models.loaded import LoadedModel

# Pillow format names a request may send (what the front-end admits too).
IMAGE_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"})  # MPO: phone cameras' JPEGs
AUDIO_FORMATS = frozenset({"wav", "mp3"})
# Decoded pixels per image: larger is refused before decoding (a decompression bomb guard).
MAX_IMAGE_PIXELS = 50_000_000
# Largest `resize_shape` side (mlx-vlm accepts any int; a huge one would only waste memory).
MAX_RESIZE_SIDE = 8192
# Decoded pixels of all of a request's images together (a few large images, or many small ones).
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS
# Seconds of audio in one request, all clips together (the transcription routes' ceiling).
MAX_AUDIO_SECONDS = 600.0
MIN_AUDIO_SECONDS = 0.1  # a clip of a few samples broke the audio tower inside the batch (a 500)
# Larger images are scaled down to this many pixels here, before the model's processor, which runs on the mlx
# thread and would otherwise resize every pixel there (two 7000x7000 images: a 2.5 s stall of every stream).
# Processors' own ceilings are lower (Qwen2-VL: 12.8 M), so what the model sees is barely changed.
MAX_PROCESSOR_PIXELS = 16_000_000
# PyAV's demuxer name for each audio format a request may declare.
_CONTAINERS = {"wav": "wav", "mp3": "mp3"}
# FFmpeg's float sample formats (packed and planar): the only ones that can hold NaN or infinity.
_FLOAT_SAMPLES = frozenset({"flt", "fltp", "dbl", "dblp"})


def _media_error(message: str, code: str = "invalid_media", param: str | None = "messages") -> RequestError:
    return RequestError(400, code, message, param=param)


def _checked_media(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ADD's media list, shape-checked (the codec only knows it is a list)."""
    media = body.get("media") or []
    for index, item in enumerate(media):
        if (not isinstance(item, dict) or item.get("type") not in ("image", "audio")
                or not isinstance(item.get("data"), bytes) or not isinstance(item.get("placeholder"), str)
                or not item["placeholder"]):
            raise _media_error(f"media[{index}] must be a map with type 'image' or 'audio', bytes 'data' and a "
                               "'placeholder' string")
    return media


def resize_shape_of(item: dict[str, Any]) -> tuple[int, int] | None:
    """mlx-vlm's `resize_shape`: [size] or [height, width], normalised to a pair; None when absent."""
    value = item.get("resize_shape")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) not in (1, 2)
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_RESIZE_SIDE for v in value)):
        raise _media_error(f"'resize_shape' must be [size] or [height, width] with sides in 1..{MAX_RESIZE_SIDE}",
                           param="resize_shape")
    return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])


def decode_image(item: dict[str, Any], index: int) -> Any:
    """The item's bytes as an RGB PIL image, EXIF orientation applied, resized when asked."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    resize = resize_shape_of(item)
    try:
        image = Image.open(io.BytesIO(item["data"]))
        if image.format not in IMAGE_FORMATS:
            raise _media_error(f"Image {index + 1} is {image.format or 'of an unknown format'}; supported formats "
                               f"are {', '.join(sorted(IMAGE_FORMATS))}", code="unsupported_image_format")
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise _media_error(f"Image {index + 1} has {image.width}x{image.height} pixels, more than "
                               f"{MAX_IMAGE_PIXELS}", code="image_too_large")
        image = ImageOps.exif_transpose(image).convert("RGB")  # convert() decodes every pixel
    except RequestError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise _media_error(f"Image {index + 1} could not be decoded: {describe(exc)}", code="invalid_image") from None
    if resize is not None:
        from mlx_vlm.utils import resize_image

        image = resize_image(image, resize)  # exactly what mlx_vlm.server does with resize_shape
    return image


def decode_audio(item: dict[str, Any], index: int, sample_rate: int) -> Any:
    """The item's wav/mp3 bytes as mono float32 samples at the processor's rate."""
    from mlx_vlm.utils import load_audio

    if item.get("format") not in AUDIO_FORMATS:
        raise _media_error(f"Audio {index + 1} must be one of {sorted(AUDIO_FORMATS)}", code="unsupported_audio_format")
    try:
        return load_audio(io.BytesIO(item["data"]), sr=sample_rate)
    except Exception as exc:  # decoders raise their own exception types
        raise _media_error(f"Audio {index + 1} could not be decoded: {describe(exc)}", code="invalid_audio") from None


def audio_seconds(data: bytes, declared: str, index: int, limit: float) -> float:
    """Seconds of audio the clip decodes to, counted up to `limit` (400 past it, or when it is no clip).

    Float samples are checked to be finite here, as they are decoded: `decode_audio` (mlx-audio's
    reader) converts through 16-bit integers, which turns NaN and infinity into full-scale noise
    that no later check can tell from sound, and the model was given that with a 200.
    """
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError, UnicodeDecodeError) as exc:
        raise _media_error(f"Audio {index + 1} could not be decoded: {describe(exc)}", code="invalid_audio") from None
    with container:
        name = container.format.name
        if name != _CONTAINERS.get(declared):
            raise _media_error(f"Audio {index + 1} is declared {declared} but holds {name}", code="invalid_audio")
        if not container.streams.audio:
            raise _media_error(f"Audio {index + 1} holds no audio stream", code="invalid_audio")
        seconds = 0.0
        try:
            for frame in container.decode(container.streams.audio[0]):
                seconds += frame.samples / max(frame.sample_rate or 0, 1)
                if frame.format.name in _FLOAT_SAMPLES and not np.isfinite(frame.to_ndarray()).all():
                    raise _media_error(f"Audio {index + 1} holds non-finite samples (NaN or infinity); audio "
                                       "samples must be finite numbers", code="invalid_audio")
                if seconds > limit:
                    raise _media_error(f"The request's audio is longer than {MAX_AUDIO_SECONDS:g} seconds",
                                       code="audio_too_long")
        except av.error.FFmpegError as exc:
            raise _media_error(f"Audio {index + 1} is corrupt: {describe(exc)}", code="invalid_audio") from None
    if seconds == 0:
        raise _media_error(f"Audio {index + 1} holds no samples", code="invalid_audio")
    return seconds


def _within(image: Any, pixels: int) -> Any:
    """The image, scaled down (aspect kept) when it has more than `pixels` pixels."""
    from PIL import Image

    if image.width * image.height <= pixels:
        return image
    scale = (pixels / (image.width * image.height)) ** 0.5
    return image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))), Image.BICUBIC)


def decode_media(body: dict[str, Any], loaded: LoadedModel) -> list[Any]:
    """Every media item of the request decoded, in `media` order: RGB PIL images and float32 samples."""
    from PIL import Image

    support = loaded.vision
    extractor = getattr(getattr(support, "processor", None), "feature_extractor", None)
    rate = getattr(extractor, "sampling_rate", 16000)
    decoded: list[Any] = []
    pixels, seconds, images, clips = 0, 0.0, 0, 0
    for item in _checked_media(body):
        if item["type"] == "image":
            try:
                with Image.open(io.BytesIO(item["data"])) as header:  # the size, without decoding a pixel
                    pixels += header.width * header.height
            except Exception:
                pass  # `decode_image` says what is wrong with it
            if pixels > MAX_REQUEST_PIXELS:
                raise _media_error(f"The request's images hold {pixels} pixels, more than {MAX_REQUEST_PIXELS}",
                                   code="image_too_large")
            decoded.append(_within(decode_image(item, images), MAX_PROCESSOR_PIXELS))
            images += 1
            continue
        if item.get("format") not in AUDIO_FORMATS:
            raise _media_error(f"Audio {clips + 1} must be one of {sorted(AUDIO_FORMATS)}",
                               code="unsupported_audio_format")
        seconds += audio_seconds(item["data"], item["format"], clips, MAX_AUDIO_SECONDS - seconds)
        samples = decode_audio(item, clips, rate)
        if samples.size < MIN_AUDIO_SECONDS * rate or not np.isfinite(samples).all():
            raise _media_error(f"Audio {clips + 1} is shorter than {MIN_AUDIO_SECONDS:g} s or not finite samples",
                               code="invalid_audio")  # an audio tower's windows need a few frames (was a 500)
        decoded.append(samples)
        clips += 1
    return decoded
