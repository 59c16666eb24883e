"""/v1/audio/transcriptions, /translations and /speech through the real stack and the official openai SDK.

One engine serves the tiny chat model with a tiny random-weight Whisper and a tiny Soprano TTS
in their auxiliary slots (model_builders/speech.py, loaded by mlx-audio's real loaders). The
clips are made here: speech from espeak-ng when it is installed (a tone otherwise) as WAV, and
the same samples encoded as MP3. Transcripts are compared with mlx-audio's `generate` run in
this process on the same decoded samples with the same options and seed; speech is decoded back
(PyAV) and its length checked across formats and speeds.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import threading
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.helpers import Frontend, client_for, error_of, running_stack

RATE = 16_000
TTS_RATE = 32_000
TOKEN_SAMPLES = 2048  # Soprano: audio samples per generated token
TTS_TOKENS = 48
MAX_AUDIO_BYTES = 4 * 1024 * 1024
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def wav_bytes(pcm: np.ndarray, rate: int = RATE) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def spoken_wav(tmp: Path, text: str) -> bytes:
    """espeak-ng saying `text` (22 kHz WAV), or a two-tone clip when espeak-ng is not installed."""
    if shutil.which("espeak-ng"):
        target = tmp / "speech.wav"
        subprocess.run(["espeak-ng", "-w", str(target), text], check=True, capture_output=True)
        return target.read_bytes()
    t = np.arange(int(1.5 * RATE)) / RATE
    return wav_bytes(0.3 * np.sin(2 * np.pi * np.where(t < 0.75, 440, 660) * t))


def wav_with_unknown_codec() -> bytes:
    """A well-formed RIFF header whose format tag no decoder knows: a corrupt file, not an unknown container."""
    fmt = struct.pack("<IHHIIHH", 16, 0x9999, 1, RATE, 2 * RATE, 2, 16)
    return b"RIFF" + struct.pack("<I", 100) + b"WAVE" + b"fmt " + fmt + b"data" + struct.pack("<I", 64) + b"\1" * 64


def mp3_of(wav: bytes) -> bytes:
    from http_frontend.parsing.audio_decode import decode_to_pcm
    from http_frontend.parsing.audio_encode import encode_all

    return encode_all(decode_to_pcm(wav, 600), "mp3", RATE)


def decoded(data: bytes) -> tuple[str, np.ndarray, int]:
    """(container name, float32 samples, rate) of an encoded file, with PyAV."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        chunks = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
        return container.format.name, np.concatenate(chunks), stream.rate


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from model_builders.speech import build_tts, build_whisper
    from model_builders.text import build_model

    root = tmp_path_factory.mktemp("audio-models")
    return {"chat": build_model(root / "tiny-chat", size="tiny", seed=0),
            "whisper": build_whisper(root / "tiny-whisper"), "tts": build_tts(root / "tiny-tts")}


@pytest.fixture(scope="module")
def stack(models: dict[str, Path], ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    """The audio models under OpenAI's names; the TTS capped at 48 tokens a segment (3 s) to keep tests quick."""
    logs = tmp_path_factory.mktemp("audio-endpoint-logs")
    (logs / "models.yaml").write_text(
        f"models:\n  - alias: whisper-1\n    path: {models['whisper']}\n"
        f"  - alias: tts-1\n    path: {models['tts']}\n    max_tokens: {TTS_TOKENS}\n")
    with running_stack(f"ipc://{ipc_dir}/audio-api.sock", logs, model=str(models["chat"]),
                       engine_args=["--model-dir", str(models["chat"].parent), "--models-config",
                                    str(logs / "models.yaml"), "--transcription-model", "whisper-1",
                                    "--speech-model", "tts-1"],
                       frontend_args=["--max-audio-bytes", str(MAX_AUDIO_BYTES)]) as (_, frontend):
        yield frontend


@pytest.fixture(scope="module")
def client(stack: Frontend) -> openai.OpenAI:
    return client_for(stack)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    wav = spoken_wav(tmp_path_factory.mktemp("clips"), "Hello world, this is a test.")
    return {"wav": wav, "mp3": mp3_of(wav)}


@pytest.fixture(scope="module")
def whisper(models: dict[str, Path]) -> Any:
    from mlx_audio.stt.utils import load

    return load(str(models["whisper"]))


def in_process(whisper: Any, clip: bytes, **options: Any) -> Any:
    """mlx-audio's own generate on the clip as the front-end decodes it, seeded as the engine seeds."""
    import mlx.core as mx

    from engine_daemon.auxiliary.transcription import FALLBACK_TEMPERATURES, SEED
    from http_frontend.parsing.audio_decode import decode_to_pcm

    pcm = decode_to_pcm(clip, 600)
    options.setdefault("temperature", FALLBACK_TEMPERATURES)
    mx.random.seed(SEED)
    return whisper.generate(mx.array(pcm), verbose=None, **options)


def stats(frontend: Frontend) -> dict[str, Any]:
    return httpx.get(f"{frontend.base_url}/stats", timeout=30).json()


# -- transcriptions -------------------------------------------------------------------------------
def test_every_response_format_matches_mlx_audio(client: openai.OpenAI, clips: dict[str, bytes],
                                                 whisper: Any) -> None:
    from http_frontend.openai.transcripts import to_srt, to_vtt

    plain = in_process(whisper, clips["wav"], temperature=0.0, return_timestamps=False)
    timed = in_process(whisper, clips["wav"], temperature=0.0, return_timestamps=True)
    assert plain.text.strip(), "the random Whisper must say something for the comparison to mean anything"

    def create(fmt: str, **extra: Any) -> Any:
        return client.audio.transcriptions.create(model="whisper-1", file=("hello.wav", clips["wav"], "audio/wav"),
                                                  response_format=fmt, temperature=0.0, **extra)

    as_json = create("json")
    assert as_json.text == plain.text
    assert as_json.usage.seconds >= 1
    assert create("text") == plain.text
    verbose = create("verbose_json", timestamp_granularities=["segment"])
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    assert verbose.text == timed.text and verbose.language == LANGUAGES[timed.language]  # detected, by name
    assert [(s.start, s.end, s.text) for s in verbose.segments] == \
        [(pytest.approx(s["start"]), pytest.approx(s["end"]), s["text"]) for s in timed.segments]
    worded = in_process(whisper, clips["wav"], temperature=0.0, word_timestamps=True)
    with_words = create("verbose_json", timestamp_granularities=["word", "segment"])
    assert [w.word for w in with_words.words] == [w["word"] for s in worded.segments for w in s["words"]]
    assert with_words.words and all(w.end >= w.start for w in with_words.words)
    result = {"text": timed.text, "segments": timed.segments}
    assert create("srt") == to_srt(result)
    assert create("vtt") == to_vtt(result)


def test_mp3_upload_and_whisper_fallback_schedule(client: openai.OpenAI, clips: dict[str, bytes],
                                                  whisper: Any) -> None:
    """An MP3 made here; no temperature: Whisper's fallback schedule, seeded, so still reproducible."""
    reply = client.audio.transcriptions.create(model="whisper-1", file=("hello.mp3", clips["mp3"], "audio/mpeg"))
    expected = in_process(whisper, clips["mp3"], return_timestamps=False)
    assert reply.text == expected.text and reply.text.strip()


def test_translation_is_whispers_translate_task(client: openai.OpenAI, clips: dict[str, bytes],
                                                whisper: Any) -> None:
    reply = client.audio.translations.create(model="whisper-1", file=("hello.wav", clips["wav"], "audio/wav"),
                                             temperature=0.0)
    translated = in_process(whisper, clips["wav"], temperature=0.0, task="translate", return_timestamps=False)
    assert reply.text == translated.text and reply.text.strip()


def test_streaming_events(client: openai.OpenAI, clips: dict[str, bytes], whisper: Any) -> None:
    events = list(client.audio.transcriptions.create(
        model="whisper-1", file=("hello.wav", clips["wav"], "audio/wav"), temperature=0.0, language="en",
        stream=True))
    expected = in_process(whisper, clips["wav"], temperature=0.0, language="en", return_timestamps=False)
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1) and len(events) >= 2
    assert events[-1].type == "transcript.text.done"
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == expected.text


def test_long_audio_runs_in_window_slices(client: openai.OpenAI, stack: Frontend, whisper: Any) -> None:
    """65 s: three 30-s windows; each decode run of a window is an encoder slice then decoder slices (one
    here: nothing decodes, so the budget is the idle one); segment times past 30 s in the later windows."""
    t = np.arange(65 * RATE) / RATE
    clip = mp3_of(wav_bytes(0.3 * np.sin(2 * np.pi * (300 + 2 * t) * t)))
    before = stats(stack)["auxiliary_jobs"].get("slices", 0)
    reply = client.audio.transcriptions.create(model="whisper-1", file=("long.mp3", clip, "audio/mpeg"),
                                               temperature=0.0, language="en", response_format="verbose_json")
    slices = stats(stack)["auxiliary_jobs"]["slices"] - before
    assert slices >= 6 and slices % 2 == 0  # two per decode run, at least one run per window
    assert reply.duration == pytest.approx(65, abs=0.2)
    assert max(s.start for s in reply.segments) >= 60.0
    first = in_process(whisper, clip, temperature=0.0, language="en")  # whole clip: mlx-audio seeks itself
    assert reply.text.startswith(first.segments[0]["text"])


def test_a_client_that_leaves_cancels_its_transcription(stack: Frontend) -> None:
    """4 minutes of audio (8 windows); the client gives up after 2 s: the engine drops the job between slices."""
    t = np.arange(240 * RATE) / RATE
    clip = mp3_of(wav_bytes(0.3 * np.sin(2 * np.pi * 330 * t)))
    before = stats(stack)["auxiliary_jobs"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.base_url}/v1/audio/transcriptions", files={"file": ("long.mp3", clip, "audio/mpeg")},
                   data={"model": "whisper-1", "temperature": "0"}, timeout=httpx.Timeout(60, read=2.0))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        jobs = stats(stack)["auxiliary_jobs"]
        if jobs.get("transcription_cancelled", 0) > before.get("transcription_cancelled", 0):
            break
        time.sleep(0.5)
    assert jobs.get("transcription_cancelled", 0) == before.get("transcription_cancelled", 0) + 1
    # Cancelled, never finished: how many slices ran before the client's 2 s ran out depends on the
    # machine's load (a loaded CI ran 8), so no bound on them here.
    assert jobs.get("transcription_done") == before.get("transcription_done")


# -- speech ------------------------------------------------------------------------------------------
SPEECH_INPUT = "Hello there, this is a speech test."
CONTAINERS = {"mp3": "mp3", "opus": "ogg", "aac": "aac", "flac": "flac", "wav": "wav"}


@pytest.fixture(scope="module")
def reference_samples(client: openai.OpenAI) -> int:
    audio = client.audio.speech.create(model="tts-1", voice="alloy", input=SPEECH_INPUT, response_format="pcm")
    samples = len(audio.content) // 2
    assert samples > 0 and samples % TOKEN_SAMPLES == 0, "Soprano writes whole tokens of 2048 samples"
    assert samples <= TTS_TOKENS * TOKEN_SAMPLES, "the models-config max_tokens caps each segment"
    return samples


def test_speech_is_mlx_audios_generate(client: openai.OpenAI, models: dict[str, Path]) -> None:
    """Token-sized slices on the engine give the very samples of one seeded `generate` call in this process."""
    import mlx.core as mx
    from mlx_audio.tts.utils import load

    from engine_daemon.auxiliary.speech import SEED

    text = SPEECH_INPUT + " And a second sentence, long enough to stand alone."
    audio = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm")
    tts = load(str(models["tts"]))  # building the model draws random numbers: seed after it
    mx.random.seed(SEED)
    expected = np.concatenate([np.asarray(r.audio, dtype=np.float32)
                               for r in tts.generate(text=text, max_tokens=TTS_TOKENS)])
    served = np.frombuffer(audio.content, dtype="<i2")
    assert served.size == expected.size
    # The engine decodes in slices (`ChunkedDecode`): equal to the one-call decode to float32 rounding (bit for bit
    # on an Intel CI machine, ~1e-7 apart on an AMD EPYC one), so a sample may truncate to the next 16-bit step.
    reference = (np.clip(expected, -1, 1) * 32767).astype("<i2")
    apart = np.abs(served.astype(np.int32) - reference.astype(np.int32))
    assert apart.max() <= 1 and np.mean(apart == 0) > 0.99


@pytest.mark.parametrize("fmt", list(CONTAINERS))
def test_speech_file_formats_play_back(client: openai.OpenAI, reference_samples: int, fmt: str) -> None:
    audio = client.audio.speech.create(model="tts-1", voice="alloy", input=SPEECH_INPUT, response_format=fmt)
    container, pcm, rate = decoded(audio.content)
    assert container == CONTAINERS[fmt]
    expected = reference_samples / TTS_RATE
    lossless = fmt in ("wav", "flac")
    assert pcm.size / rate == (pytest.approx(expected, abs=1e-6) if lossless else pytest.approx(expected, abs=0.12))
    assert np.abs(pcm).max() > 0.0


def test_speech_speed_and_streaming(stack: Frontend, reference_samples: int) -> None:
    """speed 2.0 halves the clip; the body arrives in several chunks (chunked transfer, no length)."""
    with httpx.stream("POST", f"{stack.base_url}/v1/audio/speech", timeout=60,
                      json={"model": "tts-1", "voice": "alloy", "input": SPEECH_INPUT, "response_format": "wav",
                            "speed": 2.0}) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
        assert response.headers.get("transfer-encoding") == "chunked"
        body = b"".join(response.iter_bytes())
    _, pcm, rate = decoded(body)
    assert pcm.size / rate == pytest.approx(reference_samples / TTS_RATE / 2, abs=0.05)


# -- bad input, and the chat model beside it ----------------------------------------------------------
def test_bad_input_is_a_400_and_the_engine_serves_on(client: openai.OpenAI, stack: Frontend,
                                                     clips: dict[str, bytes], models: dict[str, Path]) -> None:
    url = f"{stack.base_url}/v1/audio/transcriptions"
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4

    def upload(data: bytes, name: str, **fields: str) -> httpx.Response:
        return httpx.post(url, files={"file": (name, data)}, data={"model": "whisper-1", **fields}, timeout=60)

    cases = [(upload(b"", "empty.wav"), 400, "empty_file"),
             (upload(np.random.default_rng(0).bytes(4000), "noise.mp3"), 400, "invalid_audio"),
             (upload(b"fLaC" + np.random.default_rng(1).bytes(2000), "broken.flac"), 400, "invalid_audio"),
             (upload(wav_with_unknown_codec(), "odd.wav"), 400, "invalid_audio"),
             (upload(png, "picture.png"), 400, "unsupported_audio_format"),
             (upload(b"\0" * (MAX_AUDIO_BYTES + 1), "huge.wav"), 413, "request_too_large"),
             (upload(clips["wav"], "a.wav", response_format="docx"), 400, "invalid_value"),
             (upload(clips["wav"], "a.wav", language="xx"), 400, "invalid_value"),
             (httpx.post(url, json={"model": "whisper-1"}, timeout=30), 400, "invalid_content_type")]
    for i, (response, status, code) in enumerate(cases):
        assert response.status_code == status, (i, response.text)
        assert error_of(response)["code"] == code
    speech_url = f"{stack.base_url}/v1/audio/speech"
    for body, param in [({"input": "hi", "voice": "alloy", "response_format": "ogg"}, "response_format"),
                        ({"input": "hi", "voice": "alloy", "speed": 9}, "speed"),
                        ({"input": "  ", "voice": "alloy"}, "input"),
                        ({"input": "hi", "voice": "alloy", "instructions": "whisper it"}, "instructions")]:
        response = httpx.post(speech_url, json={"model": "tts-1", **body}, timeout=30)
        assert response.status_code == 400 and error_of(response)["param"] == param, response.text
    # A chat request naming the Whisper model is refused without evicting the chat model.
    loads = stats(stack)["model_loads"]
    with pytest.raises(openai.BadRequestError, match="transcription model"):
        client.chat.completions.create(model=str(models["whisper"]), max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert stats(stack)["model_loads"] == loads
    assert client.audio.transcriptions.create(model="whisper-1", file=("a.wav", clips["wav"], "audio/wav"),
                                              temperature=0.0).text


def test_models_list_the_audio_slots(stack: Frontend, models: dict[str, Path]) -> None:
    listed = {m["id"]: m for m in httpx.get(f"{stack.base_url}/v1/models", timeout=30).json()["data"]}
    assert listed["whisper-1"]["type"] == "transcription" and listed["whisper-1"]["loaded"]
    assert listed["tts-1"]["type"] == "speech" and listed["tts-1"]["loaded"]
    assert listed[str(models["chat"])]["type"] == "text" and listed[str(models["chat"])]["loaded"]


def test_chat_stream_runs_on_while_audio_is_served(client: openai.OpenAI, stack: Frontend,
                                                   clips: dict[str, bytes], models: dict[str, Path]) -> None:
    """A long chat stream and audio jobs share the mlx thread: the stream finishes whole, no model reloads."""
    before = stats(stack)
    chunks: list[str] = []

    def chat() -> None:
        stream = client.chat.completions.create(
            model=str(models["chat"]), messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=300, stream=True, extra_body={"ignore_eos": True})
        chunks.extend(c.choices[0].delta.content or "" for c in stream if c.choices)

    thread = threading.Thread(target=chat)
    thread.start()
    t = np.arange(40 * RATE) / RATE
    long_clip = wav_bytes(0.3 * np.sin(2 * np.pi * 350 * t))
    texts = [client.audio.transcriptions.create(model="whisper-1", file=("long.wav", long_clip, "audio/wav"),
                                                temperature=0.0).text,
             client.audio.speech.create(model="tts-1", voice="alloy", input=SPEECH_INPUT, response_format="mp3")]
    thread.join(120)
    after = stats(stack)
    assert not thread.is_alive() and texts[0] and texts[1].content
    assert after["model_loads"] == before["model_loads"], "audio must never reload the chat model"
    assert after["tokens_generated"] - before["tokens_generated"] >= 300 and "".join(chunks)
    assert after["auxiliary_jobs"]["slices"] - before["auxiliary_jobs"]["slices"] >= 3  # 2 windows + 1 segment


def test_uploads_held_at_once_are_bounded(models: dict[str, Path], ipc_dir: Path,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Red team: 20 uploads of a 91 KB FLAC (470 s of silence) held ~1.6 GB in the engine and ~2 GB in a worker.

    A worker decodes and holds --max-audio-jobs uploads at once (the rest wait, then succeed); the engine
    refuses audio past --max-queued-audio-seconds with a 429."""
    logs = tmp_path_factory.mktemp("audio-bounds")
    (logs / "models.yaml").write_text(f"models:\n  - alias: whisper-1\n    path: {models['whisper']}\n")
    with running_stack(f"ipc://{ipc_dir}/audio-bounds.sock", logs, model=str(models["chat"]),
                       engine_args=["--model-dir", str(models["chat"].parent), "--models-config",
                                    str(logs / "models.yaml"), "--transcription-model", "whisper-1",
                                    "--max-queued-audio-seconds", "20"],
                       frontend_args=["--max-audio-jobs", "1"]) as (_, frontend):
        client = client_for(frontend)
        t = np.arange(8 * RATE) / RATE
        short = wav_bytes(0.3 * np.sin(2 * np.pi * 300 * t))
        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(lambda i: client.audio.transcriptions.create(
                model="whisper-1", file=(f"{i}.wav", short, "audio/wav"), temperature=0.0).text, range(3)))
        assert len(texts) == 3  # one at a time through the worker's slot, none refused
        long = wav_bytes(0.3 * np.sin(2 * np.pi * 300 * np.arange(25 * RATE) / RATE))
        with pytest.raises(openai.RateLimitError) as info:
            client.audio.transcriptions.create(model="whisper-1", file=("long.wav", long, "audio/wav"))
        assert error_of(info.value.response)["code"] == "audio_queue_full"


# -- last: it unloads the models ---------------------------------------------------------------------
@pytest.mark.parametrize("stream_format", ["sse", "audio"])
def test_speech_cut_short_is_not_passed_off_as_whole(stack: Frontend, stream_format: str) -> None:
    """Red team: speech that failed mid-way (the model unloaded) ended as a clean 200, SSE even said `done`.

    SSE now ends with an error event and no `done`; raw audio ends without its last chunk (a broken transfer)."""
    body = {"model": "tts-1", "voice": "alloy", "input": " ".join(f"Sentence number {i} of many." for i in range(40)),
            "response_format": "wav", "stream_format": stream_format}
    events: list[str] = []
    with httpx.stream("POST", f"{stack.base_url}/v1/audio/speech", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines() if stream_format == "sse" else response.iter_bytes()
        try:
            for item in lines:
                if stream_format == "sse" and not item.startswith("data:"):
                    continue
                if not events:  # the first audio is out: the model goes while the rest is made
                    assert httpx.post(f"{stack.base_url}/unload", timeout=60).status_code == 200
                events.append(json.loads(item[5:])["type"] if stream_format == "sse" else "bytes")
        except httpx.RemoteProtocolError:
            events.append("cut")
    if stream_format == "sse":
        assert events[-1] == "error" and "speech.audio.done" not in events, events
    else:
        assert events[-1] == "cut", events[-3:]
