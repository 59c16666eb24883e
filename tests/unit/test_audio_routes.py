"""The /v1/audio routes' front-end half, in-process: transcript formats, PyAV decode/encode, multipart checks.

The engine is the `FakeEngine` stand-in (canned CALL results, every frame through the real
protocol codec), so these run in seconds; the real stack is tests/stack/test_audio_endpoints.py.
"""

from __future__ import annotations

import io
import json
import math
import wave

import numpy as np
import pytest

from http_frontend.openai.transcripts import render, to_srt, to_vtt
from http_frontend.parsing.audio_decode import decode_to_pcm
from http_frontend.parsing.audio_encode import FORMATS, StreamingEncoder, encode_all
from protocol import CallMethod
from tests.helpers import float_wav
from tests.unit.fake_engine import FakeEngine, client_for

RESULT = {"model": "whisper-1", "text": " Hello there. General Kenobi.", "language": "en", "language_name": "english",
          "duration": 3.2,
          "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": 1.5, "text": " Hello there.", "tokens": [1, 2],
                        "temperature": 0.0, "avg_logprob": math.nan, "compression_ratio": 1.1, "no_speech_prob": 0.01},
                       {"id": 1, "seek": 0, "start": 1.5, "end": 3.2, "text": " General Kenobi.", "tokens": [3],
                        "temperature": 0.0, "avg_logprob": -0.2, "compression_ratio": 1.0, "no_speech_prob": 0.02,
                        "words": [{"word": " General", "start": 1.5, "end": 2.0}]}]}


def tone_wav(seconds: float = 1.0, rate: int = 22_050) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes((0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def multipart(fields: dict[str, str | list[str]], file: tuple[str, bytes] | None) -> tuple[bytes, str]:
    boundary = "testboundary1234"
    parts = []
    for name, value in fields.items():
        for item in value if isinstance(value, list) else [value]:
            parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{item}\r\n'.encode())
    if file is not None:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{file[0]}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + file[1] + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_srt_and_vtt_cues() -> None:
    assert to_srt(RESULT) == ("1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
                              "2\n00:00:01,500 --> 00:00:03,200\nGeneral Kenobi.\n\n")
    assert to_vtt(RESULT).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n")


def test_verbose_json_is_strict_json() -> None:
    body, media = render(RESULT, "verbose_json", "transcribe", words=True)
    assert media == "application/json" and body["language"] == "english" and body["duration"] == 3.2
    assert body["segments"][0]["avg_logprob"] == 0.0  # NaN is not JSON
    assert body["words"] == [{"word": " General", "start": 1.5, "end": 2.0}]
    json.dumps(body, allow_nan=False)
    assert render(RESULT, "json", "transcribe")[0] == {"text": RESULT["text"], "usage": {"type": "duration",
                                                                                         "seconds": 4}}


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pcm"])
def test_encoded_speech_decodes_to_its_length(fmt: str) -> None:
    rate = 24_000
    pcm = (0.2 * np.sin(2 * np.pi * 300 * np.arange(rate * 2) / rate)).astype(np.float32)
    encoder = StreamingEncoder(fmt, rate)
    data = b"".join(encoder.feed(pcm[i:i + 4000]) for i in range(0, pcm.size, 4000)) + encoder.finish()
    decoded = decode_to_pcm(data, 60)  # back through the upload decoder, at 16 kHz
    assert decoded.size / 16_000 == pytest.approx(2.0, abs=0.1)


@pytest.mark.parametrize("muxer,codec,rate", [("ipod", "aac", 44_100), ("webm", "libopus", 48_000),
                                              ("ogg", "libopus", 48_000)])
def test_m4a_webm_and_ogg_uploads_decode(muxer: str, codec: str, rate: int) -> None:
    """Containers the SDK may send that the speech encoder does not write: m4a (AAC in MP4), WebM, Ogg."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=muxer) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "mono"
        resampler = av.AudioResampler(format=stream.codec_context.codec.audio_formats[0].name, layout="mono",
                                      rate=rate)
        frame = av.AudioFrame.from_ndarray((0.2 * np.sin(np.arange(rate) / 10)).astype(np.float32)[None],
                                           format="flt", layout="mono")
        frame.sample_rate = rate
        for resampled in resampler.resample(frame):
            for packet in stream.encode(resampled):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    assert decode_to_pcm(buffer.getvalue(), 60).size / 16_000 == pytest.approx(1.0, abs=0.06)


def test_speed_changes_the_length_not_the_rate() -> None:
    rate = 16_000
    pcm = (0.2 * np.sin(2 * np.pi * 300 * np.arange(rate * 2) / rate)).astype(np.float32)
    fast = encode_all(pcm, "pcm", rate, speed=2.0)
    slow = encode_all(pcm, "pcm", rate, speed=0.5)
    assert len(fast) / 2 / rate == pytest.approx(1.0, abs=0.05)
    assert len(slow) / 2 / rate == pytest.approx(4.0, abs=0.1)


def test_upload_becomes_16khz_float32_samples_in_one_call() -> None:
    engine = FakeEngine()
    engine.replies[CallMethod.TRANSCRIBE] = lambda args: {**RESULT, "duration": len(args["audio"]) / 4 / 16_000}
    body, content_type = multipart({"model": "whisper-1", "response_format": "srt", "language": "EN"},
                                   ("clip.wav", tone_wav(1.0)))
    response = client_for(engine).simulate_post("/v1/audio/transcriptions", body=body,
                                                headers={"Content-Type": content_type})
    assert response.status_code == 200, response.text
    assert response.text == to_srt(RESULT)
    [(method, args)] = engine.calls
    assert method == "audio.transcribe" and args["task"] == "transcribe" and args["language"] == "en"
    assert len(args["audio"]) == 4 * 16_000 and args["timestamps"] and args["temperature"] is None


@pytest.mark.parametrize("fields,file,status,code", [
    ({"model": "whisper-1"}, None, 400, "missing_required_parameter"),
    ({"model": "whisper-1"}, ("empty.wav", b""), 400, "empty_file"),
    ({"model": "whisper-1"}, ("junk.mp3", b"\x00\x01junk" * 300), 400, "invalid_audio"),
    ({"model": "whisper-1"}, ("page.html", b"<html><body>hello</body></html>" * 20), 400, "invalid_audio"),
    ({"model": "whisper-1", "response_format": "xml"}, ("clip.wav", tone_wav(0.2)), 400, "invalid_value"),
    ({"model": "whisper-1", "timestamp_granularities[]": ["word"]}, ("clip.wav", tone_wav(0.2)), 400,
     "invalid_value"),
    ({"model": "whisper-1", "temperature": "hot"}, ("clip.wav", tone_wav(0.2)), 400, "invalid_type"),
    ({"model": "whisper-1", "stream": "true", "response_format": "srt"}, ("clip.wav", tone_wav(0.2)), 400,
     "unsupported_parameter"),
    ({}, ("clip.wav", tone_wav(0.2)), 400, "missing_required_parameter"),
])
def test_bad_uploads_never_reach_the_engine(fields: dict, file: tuple | None, status: int, code: str) -> None:
    engine = FakeEngine()
    body, content_type = multipart(fields, file)
    response = client_for(engine).simulate_post("/v1/audio/transcriptions", body=body,
                                                headers={"Content-Type": content_type})
    assert response.status_code == status, response.text
    assert response.json["error"]["code"] == code
    assert "audio.transcribe" not in engine.methods_called()


def test_speech_request_checks() -> None:
    engine = FakeEngine()
    client = client_for(engine)
    for body, param in [({"model": "tts-1", "voice": "alloy"}, "input"),
                        ({"model": "tts-1", "voice": "alloy", "input": "hi", "response_format": "ogg"},
                         "response_format"),
                        ({"model": "tts-1", "voice": "alloy", "input": "hi", "speed": 0.1}, "speed"),
                        ({"model": "tts-1", "voice": "alloy", "input": "x" * 5000}, "input")]:
        response = client.simulate_post("/v1/audio/speech", json=body)
        assert response.status_code == 400 and response.json["error"]["param"] == param, response.text
    assert engine.calls == []


@pytest.mark.parametrize("route", ["transcriptions", "translations"])
@pytest.mark.parametrize("dtype", ["<f4", "<f8"])
def test_an_upload_with_non_finite_samples_is_a_400(route: str, dtype: str) -> None:
    samples = np.sin(np.arange(8000) / 10) * 0.5
    samples[[10, 20, 30]] = [np.nan, np.inf, -np.inf]
    engine = FakeEngine()
    body, content_type = multipart({"model": "whisper-1"}, ("clip.wav", float_wav(samples, 22_050, dtype)))
    response = client_for(engine).simulate_post(f"/v1/audio/{route}", body=body,
                                                headers={"Content-Type": content_type})
    assert response.status_code == 400, response.text
    assert response.json["error"] == {"message": "The uploaded audio holds non-finite samples (NaN or infinity); "
                                                 "audio samples must be finite numbers",
                                      "type": "invalid_request_error", "param": "file", "code": "invalid_audio"}
    assert engine.calls == []
