"""A chat stream's pace while transcriptions and speech are served beside it (issue #19, audio half).

One engine holds the chat model, a Whisper and a TTS model (random weights, model_builders). A
greedy stream runs; once it is steady, transcription requests (clips of `--clip-seconds`, so
several 30-s windows each) and speech requests are sent by a few concurrent clients. The
stream's inter-token latency comes from the engine's own per-step timing (CALL `step_gaps`):
p50 while steady, p99 while audio is served, and their ratio. A Whisper slice is one encoder
pass or about a budget of decoder tokens (sized from the measured decode step); a TTS slice is
32 language-model tokens or one sentence's Vocos decode, so the ratio says how long the largest
such slice holds the mlx thread compared with a decode step.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/audio.py

Figures go to bench/README.md.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.embeddings import Stream, gaps_since, wait_for_gaps  # noqa: E402
from bench.loadgen import percentile  # noqa: E402
from bench.stack import DEFAULT_MODELS, bench_model, our_stack  # noqa: E402
from model_builders.speech import build_tts, build_whisper  # noqa: E402


def clip(seconds: float, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((0.3 * np.sin(2 * np.pi * (300 + 3 * t) * t) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def transcribe(base: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{base}/audio/transcriptions", files={"file": ("clip.wav", data, "audio/wav")},
                      data={"model": "whisper-1", "temperature": "0", "language": "en"}, timeout=600)


def speak(base: str, text: str) -> httpx.Response:
    return httpx.post(f"{base}/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": text,
                                                    "response_format": "mp3"}, timeout=600)


def run(chat: Path, whisper: Path, tts: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine_args = ["--transcription-model", str(whisper), "--speech-model", str(tts)]
    data = clip(args.clip_seconds)
    with our_stack(chat, engine_args) as (base, engine):
        transcribe(base, clip(2.0))  # warm both slots
        speak(base, "Warm up.")
        start, _ = gaps_since(engine.endpoint, 0)
        stream = Stream(base, str(chat), args.max_tokens)
        stream.start()
        count, _ = wait_for_gaps(engine.endpoint, start, 20)
        count, steady = wait_for_gaps(engine.endpoint, count, args.steady_tokens)
        before = httpx.get(f"{base.removesuffix('/v1')}/stats", timeout=30).json()
        jobs = [("t", None)] * args.transcriptions + [("s", "Hello there. This is a short benchmark sentence.")] \
            * args.speeches
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda job: transcribe(base, data) if job[0] == "t" else speak(base, job[1]),
                                    jobs))
        served = time.monotonic() - started
        count, during = gaps_since(engine.endpoint, count)
        stream.stop.set()
        after = httpx.get(f"{base.removesuffix('/v1')}/stats", timeout=30).json()
    p50, p99 = percentile(steady, 50), percentile(during, 99)
    return {"transcriptions": args.transcriptions, "clip_seconds": args.clip_seconds, "speeches": args.speeches,
            "requests_ok": sum(a.status_code == 200 for a in answers), "audio_seconds_wall": round(served, 2),
            "audio_slices": after["auxiliary_jobs"].get("slices", 0) - before["auxiliary_jobs"].get("slices", 0),
            "steady_itl_p50_ms": round(p50, 1), "during_itl_p50_ms": round(percentile(during, 50), 1),
            "during_itl_p99_ms": round(p99, 1), "during_itl_max_ms": round(max(during or [0]), 1),
            "ratio_p99_during_over_p50_steady": round(p99 / p50, 2), "steps_during": len(during),
            "model_loads_before": before["model_loads"], "model_loads_after": after["model_loads"],
            "stream_error": stream.error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chat-size", default="realistic", help="model_builders.text size of the chat model")
    parser.add_argument("--transcriptions", type=int, default=4)
    parser.add_argument("--clip-seconds", type=float, default=65.0)
    parser.add_argument("--speeches", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--steady-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    args = parser.parse_args()
    chat = bench_model(args.chat_size)
    whisper = build_whisper(DEFAULT_MODELS / "tiny-whisper")
    tts = build_tts(DEFAULT_MODELS / "tiny-tts")
    result = run(chat, whisper, tts, args)
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
