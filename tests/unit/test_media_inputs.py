"""Images and audio in requests: checks and decoding, without processes."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image

from http_frontend.parsing.media import MediaCollector, audio_format_of
from http_frontend.settings import FrontendSettings
from tests.helpers import data_url, float_wav, png

IMAGE = png(2)


OTHER_IMAGE = png(5)


def test_placeholders_and_audio_sniffing() -> None:
    media = MediaCollector(FrontendSettings(), resize_shape=[56])
    first = media.add_part({"type": "input_image", "image_url": data_url(IMAGE)}, "p", "user")
    second = media.add_part({"type": "image_url", "image_url": {"url": data_url(OTHER_IMAGE)}}, "p", "user")
    assert first != second and first.startswith("<|media:")
    # Another request's placeholders differ: a client cannot guess them.
    assert MediaCollector(FrontendSettings()).add_part({"type": "image_url", "image_url": data_url(IMAGE)},
                                                       "p", "user") != first
    items = asyncio.run(media.resolve())
    assert [i["placeholder"] for i in items] == [first, second]
    assert items[0]["resize_shape"] == [56]
    assert audio_format_of(b"RIFF\0\0\0\0WAVEfmt ") == "wav"
    assert audio_format_of(b"ID3\x04rest") == "mp3" and audio_format_of(b"\xff\xfbdata") == "mp3"
    assert audio_format_of(b"OggS....") is None


def test_exif_orientation_and_resize_are_applied() -> None:
    from engine_daemon.multimodal import inputs as vision

    photo = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    Image.new("RGB", (120, 60), (200, 10, 10)).save(photo, "JPEG", exif=exif)
    assert vision.decode_image({"data": photo.getvalue()}, 0).size == (60, 120)
    assert vision.decode_image({"data": photo.getvalue(), "resize_shape": [30]}, 0).size == (15, 30)
    with pytest.raises(vision.RequestError) as caught:
        vision.decode_image({"data": b"GIF89a" + bytes(20)}, 0)
    assert caught.value.code == "invalid_image"


def test_wav_audio_is_decoded_to_the_processor_rate() -> None:
    import wave

    from engine_daemon.multimodal import inputs as vision

    clip = io.BytesIO()
    with wave.open(clip, "wb") as out:
        out.setnchannels(2)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes((np.sin(np.arange(8000) / 10) * 8000).astype("<i2").repeat(2).tobytes())
    samples = vision.decode_audio({"format": "wav", "data": clip.getvalue()}, 0, 16000)
    assert samples.dtype == np.float32 and samples.shape == (16000,)  # one second, mono, resampled
    with pytest.raises(vision.RequestError) as caught:
        vision.decode_audio({"format": "wav", "data": b"RIFF\0\0\0\0WAVEjunk"}, 0, 16000)
    assert caught.value.code == "invalid_audio"


def test_huge_images_reach_the_processor_scaled_down() -> None:
    """Re-verification: two 7000x7000 images were resized pixel by pixel by the processor on the mlx thread
    (a 2.5 s stall of every stream); the admission pool scales them to MAX_PROCESSOR_PIXELS first."""
    from engine_daemon.multimodal import media_decode

    big = media_decode._within(Image.new("RGB", (8000, 4000)), media_decode.MAX_PROCESSOR_PIXELS)
    assert big.width * big.height <= media_decode.MAX_PROCESSOR_PIXELS and abs(big.width / big.height - 2) < 0.01
    small = Image.new("RGB", (640, 480))
    assert media_decode._within(small, media_decode.MAX_PROCESSOR_PIXELS) is small  # untouched: same pixels


@pytest.mark.parametrize("dtype", ["<f4", "<f8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_float_audio_with_non_finite_samples_is_a_400(dtype: str, bad: float) -> None:
    """Fuzzing: a float WAV holding NaN or infinity was given to the model (mlx-audio's reader turns them into
    full-scale noise through 16-bit integers) with a 200; its samples are now checked as PyAV measures the clip."""
    from types import SimpleNamespace

    from engine_daemon.multimodal import media_decode

    samples = np.sin(np.arange(8000) / 10) * 0.5
    loaded = SimpleNamespace(vision=None)
    assert len(media_decode.decode_media({"media": [
        {"type": "audio", "format": "wav", "data": float_wav(samples, dtype=dtype), "placeholder": "<a>"}]},
        loaded)[0]) == 8000  # finite float samples are audio like any other
    samples[4000] = bad
    with pytest.raises(media_decode.RequestError) as caught:
        media_decode.decode_media({"media": [
            {"type": "audio", "format": "wav", "data": float_wav(samples, dtype=dtype), "placeholder": "<a>"}]},
            loaded)
    error = caught.value
    assert (error.status, error.code) == (400, "invalid_audio")
    assert "Audio 1 holds non-finite samples (NaN or infinity)" in str(error)
