"""Decode steps at long contexts on the CPU: `--cpu-decode-attention numpy` against `mlx`, one server at a time.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/long_context_decode.py --size small --streams 5 --context-words 1500 --rounds 2

Each round starts our stack once per setting (alternated), warms it up, then sends `--streams`
requests at once with distinct ~`--context-words`-word prompts and `--max-tokens` greedy tokens.
The figure is the engine's own: with the engine at DEBUG its log has one line per generator
step (time, streams, prompt tokens), and a step that decodes every stream and prefills nothing
is a decode step at that context. Its median is the decode step; streams over it are tokens/s.
Writes bench/results/long_context_decode-<size>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from loadgen import one_request  # noqa: E402
from long_prompt_gaps import engine_steps  # noqa: E402
from scenarios import NO_PENALTY, words  # noqa: E402
from stack import bench_model, our_stack  # noqa: E402


async def decode_burst(base: str, model: str, streams: int, context_words: int, max_tokens: int, seed: int) -> int:
    """Sends `streams` long prompts at once; returns about how many prompt tokens each had."""
    url = f"{base}/chat/completions"

    def body(prompt: str) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **NO_PENALTY}

    async with httpx.AsyncClient(timeout=3600) as http:
        await one_request(http, url, body(words(50, seed)))  # warm-up
        await one_request(http, url, body(words(50, seed + 99)))
        results = await asyncio.gather(*(one_request(http, url, body(words(context_words, seed + 1 + i)))
                                         for i in range(streams)))
    if not all(result.ok for result in results):
        raise RuntimeError(f"a request failed: {[result.error for result in results if not result.ok]}")
    stats = httpx.get(f"{base.removesuffix('/v1')}/stats").json()
    return round((stats.get("prompt_tokens") or 0) / (streams + 2))  # the warm-ups' few tokens count too


def decode_step_ms(log: str, streams: int) -> tuple[float, int]:
    """(median, count) of the engine's steps that decoded `streams` streams and prefilled nothing."""
    times = [ms for _ended, ms, decoding, prompt in engine_steps(log) if decoding == streams and prompt == 0]
    if len(times) < 5:
        raise RuntimeError(f"only {len(times)} decode steps of {streams} streams in the engine's log")
    return statistics.median(times), len(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--streams", type=int, default=5)
    parser.add_argument("--context-words", type=int, default=1500, help="~1.3 tokens a word")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ["MLX_ENGINE_LOG_LEVEL"] = "DEBUG"
    model = bench_model(args.size)
    rows: list[dict] = []
    for round_ in range(args.rounds):
        for setting in ("mlx", "numpy"):
            with our_stack(model, ["--decode-concurrency", str(max(8, args.streams)),
                                   "--cpu-decode-attention", setting]) as (base, engine):
                prompt_tokens = asyncio.run(decode_burst(base, str(model), args.streams, args.context_words,
                                                         args.max_tokens, 100 * round_))
                median, count = decode_step_ms(engine.log_path.read_text(), args.streams)
            row = {"round": round_, "setting": setting, "prompt_tokens": prompt_tokens, "decode_step_ms": median,
                   "steps": count, "tokens_per_second": args.streams * 1000 / median}
            rows.append(row)
            print(f"round {round_} {setting:5}: {args.streams} streams at ~{prompt_tokens} tokens: decode step "
                  f"{median:.1f} ms (median of {count}), {row['tokens_per_second']:.1f} tok/s", flush=True)
    by = {s: statistics.median(r["decode_step_ms"] for r in rows if r["setting"] == s) for s in ("mlx", "numpy")}
    print(f"median decode step: mlx {by['mlx']:.1f} ms, numpy {by['numpy']:.1f} ms ({by['mlx'] / by['numpy']:.2f}x)")
    out = HERE / "results" / f"long_context_decode-{args.size}.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "median_step_ms": by}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
