"""Audio input through the real stack: openai SDK -> gunicorn -> engined -> mlx-vlm's audio tower.

A dedicated engine serves a --model-dir holding a tiny random-weight Gemma 4 with an audio
conformer (model_builders/audio.py, loaded by the real `mlx_vlm.load`). Chat requests
carry `input_audio` parts (base64 WAV, as mlx_vlm.server takes them); the server's greedy
output and prompt size are compared with `mlx_vlm.generate` in this process for the same clip
and prompt.
"""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.helpers import Frontend, float_wav, running_stack

MODEL = "tiny-gemma4-audio"
PROMPT = "What is this sound?"
RATE = 16_000
MAX_TOKENS = 12

# Gemma 4's log-mel front end (128 mel bins over a 512-point FFT) leaves its lowest filters empty,
# exactly as with the real checkpoints' settings; transformers warns about it on every clip.
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values")


def sine_wav(freq: float, seconds: float = 0.5, rate: int = RATE) -> bytes:
    """A mono 16-bit PCM WAV of a sine tone."""
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes(pcm.tobytes())
    return out.getvalue()


CLIP = sine_wav(440)
OTHER_CLIP = sine_wav(880)
LONG_CLIP = sine_wav(440, seconds=1.0)


def audio_part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_builders.audio import build_audio_vlm

    root = tmp_path_factory.mktemp("audio-models")
    build_audio_vlm(root / MODEL, seed=0)
    return root


@pytest.fixture(scope="module")
def stack(model_dir: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    logs = tmp_path_factory.mktemp("audio-logs")
    with running_stack(f"ipc://{ipc_dir}/audio.sock", logs, engine_args=["--model-dir", str(model_dir)],
                       model_loaded=False) as (_, frontend):
        yield frontend


@pytest.fixture(scope="module")
def client(stack: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def generate_in_process(model_dir: Path, clips: list[bytes], tmp_path: Path) -> dict[str, Any]:
    """mlx_vlm.generate in this process: greedy output for each clip with PROMPT."""
    from mlx_vlm import apply_chat_template, generate, load

    model, processor = load(str(model_dir / MODEL))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_audios=1)
    results = []
    for index, clip in enumerate(clips):
        path = tmp_path / f"clip{index}.wav"
        path.write_bytes(clip)
        out = generate(model, processor, prompt, audio=[str(path)], max_tokens=MAX_TOKENS, temperature=0.0)
        # The comparison is on text: make sure it is the plain decode of the tokens.
        assert out.text == processor.tokenizer.decode(out.token_ids)
        results.append({"text": out.text, "prompt_tokens": out.prompt_tokens, "tokens": out.generation_tokens})
    return {"clip": results[0], "other": results[1], "long": results[2]}


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return generate_in_process(model_dir, [CLIP, OTHER_CLIP, LONG_CLIP], tmp_path_factory.mktemp("audio-ref"))


def audio_chat(client: openai.OpenAI, clip: bytes, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}, audio_part(clip)]}], **extra)


def test_input_audio_matches_mlx_vlm_generate(client: openai.OpenAI, stack: Frontend,
                                              reference: dict[str, Any]) -> None:
    expected = reference["clip"]
    result = audio_chat(client, CLIP)
    assert result.choices[0].message.content == expected["text"]
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == expected["prompt_tokens"]
    assert result.usage.completion_tokens == expected["tokens"] == MAX_TOKENS

    chunks = list(audio_chat(client, CLIP, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].usage.prompt_tokens == expected["prompt_tokens"]

    health = httpx.get(f"{stack.base_url}/health", timeout=10).json()
    assert health["loaded_model"] == MODEL and health["loaded_model_kind"] == "vision"  # audio + vision towers


def test_image_and_audio_in_one_message(client: openai.OpenAI, model_dir: Path, tmp_path: Path,
                                        reference: dict[str, Any]) -> None:
    """The model also sees images: an image and a clip together give mlx_vlm.generate's answer."""
    from mlx_vlm import apply_chat_template, generate, load
    from PIL import Image

    pixels = (np.random.default_rng(2).random((96, 96, 3)) * 255).astype("uint8")
    image = io.BytesIO()
    Image.fromarray(pixels).save(image, "PNG")
    (tmp_path / "clip.wav").write_bytes(CLIP)
    model, processor = load(str(model_dir / MODEL))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1, num_audios=1)
    expected = generate(model, processor, prompt, image=[Image.fromarray(pixels)], audio=[str(tmp_path / "clip.wav")],
                        max_tokens=MAX_TOKENS, temperature=0.0)

    image_url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    result = client.chat.completions.create(
        model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                               {"type": "text", "text": PROMPT}, audio_part(CLIP)]}])
    assert result.choices[0].message.content == expected.text != reference["clip"]["text"]
    assert result.usage.prompt_tokens == expected.prompt_tokens > reference["clip"]["prompt_tokens"]


def test_audio_steers_the_output(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    """Another clip, another answer; a longer clip, more prompt tokens (one per 40 ms): as in-process."""
    other = audio_chat(client, OTHER_CLIP)
    assert other.choices[0].message.content == reference["other"]["text"] != reference["clip"]["text"]
    longer = audio_chat(client, LONG_CLIP)
    assert longer.choices[0].message.content == reference["long"]["text"]
    assert longer.usage.prompt_tokens == reference["long"]["prompt_tokens"]
    assert longer.usage.prompt_tokens - reference["clip"]["prompt_tokens"] == 25 - 13  # ceil(ms / 40)


def test_audio_and_text_requests_batch_together(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    """Concurrent audio requests beside a text-only one: each gets exactly its own greedy answer."""
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(audio_chat, client, CLIP)
        second = pool.submit(audio_chat, client, OTHER_CLIP)
        text = pool.submit(client.chat.completions.create, model=MODEL, max_tokens=4, temperature=0,
                           messages=[{"role": "user", "content": PROMPT}])
        assert first.result().choices[0].message.content == reference["clip"]["text"]
        assert second.result().choices[0].message.content == reference["other"]["text"]
        assert text.result().usage.completion_tokens == 4


def test_bad_audio_is_a_400(client: openai.OpenAI) -> None:
    """An undecodable clip is refused before admission; the engine serves the next request as before."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                                   audio_part(b"RIFF\0\0\0\0WAVEjunk")]}])
    assert caught.value.status_code == 400 and caught.value.body["code"] == "invalid_audio", caught.value.body
    assert audio_chat(client, CLIP).usage.completion_tokens == MAX_TOKENS


def test_non_finite_float_audio_is_a_400(client: openai.OpenAI) -> None:
    """Fuzzing: a float32/float64 WAV of NaN or infinity was served with a 200 (the model heard full-scale noise)."""
    samples = 0.3 * np.sin(np.arange(RATE // 2) / 10)
    samples[100] = np.nan
    for dtype in ("<f4", "<f8"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": PROMPT}, audio_part(float_wav(samples, dtype=dtype))]}])
        assert caught.value.body["code"] == "invalid_audio" and caught.value.body["type"] == "invalid_request_error"
        assert "non-finite samples" in caught.value.body["message"]
    samples[100] = -np.inf
    clip = base64.b64encode(float_wav(samples)).decode()
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_text", "text": PROMPT}, {"type": "input_audio", "input_audio": {"data": clip,
                                                                                           "format": "wav"}}]}])
    assert caught.value.body["param"] == "input" and "non-finite samples" in caught.value.body["message"]
    samples[100] = 0.0  # the same clip with finite samples is audio like any other
    assert audio_chat(client, float_wav(samples)).usage.completion_tokens == MAX_TOKENS


def adts_aac(seconds: float = 1.0) -> bytes:
    """AAC in an ADTS stream: its sync word passes for mp3's, so only its decoder can tell them apart."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="adts") as container:
        stream = container.add_stream("aac", rate=RATE)
        stream.layout = "mono"
        for i in range(int(seconds * RATE / 1024)):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = RATE, i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def test_hostile_audio_is_measured_and_refused_off_the_mlx_thread(client: openai.OpenAI, stack: Frontend) -> None:
    """Red team: a 10 MB 8-bit WAV of 2.8 hours was decoded whole on the mlx thread (a 40 s stall, 2 GB), AAC
    passed as mp3, and a header-only WAV was a 500. Media are now decoded on the admission pool, each clip's
    length counted first (at most 600 s a request) and its container checked against its declared format."""
    def refused(data: bytes, fmt: str = "wav") -> dict:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "text", "text": PROMPT}, audio_part(data, fmt)]}])
        return caught.value.body

    def stats() -> dict:
        return httpx.get(f"{stack.base_url}/stats", timeout=30).json()

    long_wav = io.BytesIO()
    with wave.open(long_wav, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(1)
        clip.setframerate(1000)
        clip.writeframes(bytes([128]) * 1000 * 601)  # 601 s of 8-bit silence in 601 KB
    before = stats().get("media_decoded", 0)
    assert refused(long_wav.getvalue())["code"] == "audio_too_long"
    assert refused(adts_aac(), "mp3")["code"] == "invalid_audio"
    assert refused(sine_wav(440, seconds=0))["code"] == "invalid_audio"  # a header and no samples
    assert refused(sine_wav(440, seconds=0.005))["code"] == "invalid_audio"  # 80 samples: was a 500
    assert stats()["media_decoded"] == before + 4  # every one measured on the admission pool
    assert audio_chat(client, CLIP).usage.completion_tokens == MAX_TOKENS
