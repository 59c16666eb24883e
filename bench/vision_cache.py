"""Time to first token of an image request, first time vs. the same image again (vision feature cache).

Full stack (openai-style HTTP -> gunicorn -> engined -> mlx-vlm) on the `bench` random-weight
Qwen2-VL of model_builders/vlm.py (72M parameters; a 448x448 image is 1024 patches through a
12-block vision tower, 256 image tokens). For each run a new image is sent:

1. first turn: the image and a question -> vision tower + prefill;
2. next turn of the same conversation (image, answer, follow-up question) -> the image's features
   come from the cache, only the prefill runs;
3. the first request again, unchanged.

Prints the median TTFT of each (streamed; first non-empty content delta) and the engine's
vision cache counters.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/vision_cache.py --runs 5
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.stack import DEFAULT_MODELS, our_stack  # noqa: E402

QUESTION = "Describe this image in detail."


def image_url(seed: int, side: int) -> str:
    pixels = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def first_turn(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def ttft(base: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """(seconds to the first content delta, full text, prompt tokens) of one streamed chat request."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, prompt_tokens = None, [], 0
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", ()):
                content = choice["delta"].get("content")
                if content:
                    first = first or time.perf_counter() - started
                    text.append(content)
    return first or time.perf_counter() - started, "".join(text), prompt_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--side", type=int, default=448, help="image side in pixels (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", type=Path, default=None, help="a VLM directory (default: build the bench one)")
    args = parser.parse_args()
    from model_builders.vlm import build_vlm

    model = args.model or build_vlm(DEFAULT_MODELS / "bench-qwen2-vl", size="bench")
    with our_stack(model) as (base, engine):
        ttft(base, first_turn(image_url(10_000, args.side)), args.max_tokens)  # warm-up: first-call overheads
        cold, warm_turn, repeat = [], [], []
        prompt_tokens = 0
        for run in range(args.runs):
            url = image_url(run, args.side)
            seconds, answer, prompt_tokens = ttft(base, first_turn(url), args.max_tokens)
            cold.append(seconds)
            follow_up = first_turn(url) + [{"role": "assistant", "content": answer},
                                           {"role": "user", "content": "And what colours does it have?"}]
            warm_turn.append(ttft(base, follow_up, args.max_tokens)[0])
            repeat.append(ttft(base, first_turn(url), args.max_tokens)[0])
        stats = httpx.get(base.replace("/v1", "") + "/stats", timeout=30).json()

    def ms(values: list[float]) -> str:
        low, high = min(values) * 1000, max(values) * 1000
        return f"{statistics.median(values) * 1000:8.1f} ms (min {low:.1f}, max {high:.1f})"

    print(f"model {model.name}: {args.side}x{args.side} image, {prompt_tokens} prompt tokens, {args.runs} runs")
    print(f"TTFT first request, new image         {ms(cold)}")
    print(f"TTFT next turn, same image (cached)   {ms(warm_turn)}")
    print(f"TTFT same request again (cached)      {ms(repeat)}")
    print(f"speed-up same request: {statistics.median(cold) / statistics.median(repeat):.2f}x")
    print(f"engine: vision_images_encoded={stats.get('vision_images_encoded')} "
          f"vision_feature_cache_hits={stats.get('vision_feature_cache_hits')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
