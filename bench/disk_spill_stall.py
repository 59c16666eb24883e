"""Running streams while the prefix cache evicts long prompts' KV to `--prompt-cache-dir`.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/disk_spill_stall.py --size wide-kv --long-prompts 3

The memory tier holds one entry (`--prompt-cache-size 1`), so each long prompt's KV, shared once
its prefill ends, evicts the one before it to disk: on the `wide-kv` model (an 8B model's KV per
token) a ~3,000-token prompt's KV is ~0.4 GB. Then the first long prompt comes again and its KV is
read back from disk. Four streams decode throughout. Reported: the
streams' steady inter-token gap before the long prompts, their worst gap while they run and
how many gaps exceeded 5x steady (client clock); from the engine's log at DEBUG its longest
period between two steps and its longest time outside any step (where a write on the mlx
thread showed: the period less the step's own time); the disk tier's counters. `--engine-args` passes more flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from long_prompt_gaps import engine_steps  # noqa: E402
from prompt_scenarios import no_eos  # noqa: E402
from scenarios import NO_PENALTY, words  # noqa: E402
from stack import bench_model, our_stack  # noqa: E402


async def stream_until(http: httpx.AsyncClient, url: str, body: dict, stop: asyncio.Event) -> list[float]:
    """Arrival times (perf_counter) of a stream's chunks until `stop` is set (then the client leaves)."""
    times: list[float] = []
    async with http.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
            if stop.is_set():
                break
    return times


async def run(base: str, model: str, extra: dict, args: argparse.Namespace) -> dict:
    url = f"{base}/chat/completions"

    def body(prompt: str, max_tokens: int, stream: bool = True) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": stream, **extra}

    async with httpx.AsyncClient(timeout=3600) as http:
        await http.post(url, json=body(words(50, 1), 4, stream=False))  # warm up
        stop = asyncio.Event()
        streams = [asyncio.create_task(stream_until(http, url, body(words(60, 500 + i), 100_000), stop))
                   for i in range(4)]
        await asyncio.sleep(args.steady_seconds)
        began = time.perf_counter()
        for k in range(args.long_prompts):
            reply = await http.post(url, json=body(words(args.long_words, 900 + k), 1, stream=False))
            reply.raise_for_status()
        # The first long prompt again: its KV was evicted to disk, and is read back beside the streams.
        restored = (await http.post(url, json=body(words(args.long_words, 900), 1, stream=False))).json()
        ended = time.perf_counter()
        await asyncio.sleep(2.0)  # the last eviction's write, if any, while the streams still run
        stop.set()
        times = await asyncio.gather(*streams)
        stats = (await http.get(base.removesuffix("/v1") + "/stats")).json()
    steady = [b - a for t in times for a, b in zip(t, t[1:]) if b < began]
    during = [b - a for t in times for a, b in zip(t, t[1:]) if a >= began and b <= ended + 2.0]
    median = statistics.median(steady)
    offset = time.time() - time.perf_counter()
    return {"steady_gap_ms": median * 1000, "worst_gap_ms": max(during) * 1000,
            "worst_over_steady": max(during) / median,
            "gaps_over_5x": sum(gap > 5 * median for gap in during), "gaps_during": len(during),
            "window": (began + offset, ended + 2.0 + offset),
            "restored_cached_tokens": restored["usage"]["prompt_tokens_details"]["cached_tokens"],
            "restored_prompt_tokens": restored["usage"]["prompt_tokens"],
            "disk": {key: value for key, value in stats.items() if key.startswith("prompt_cache_disk")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="wide-kv")
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-words", type=int, default=2000, help="~3,000 tokens")
    parser.add_argument("--steady-seconds", type=float, default=8.0)
    parser.add_argument("--engine-args", default="", help="extra engined flags, space-separated")
    args = parser.parse_args()
    os.environ["MLX_ENGINE_LOG_LEVEL"] = "DEBUG"
    model = bench_model(args.size)
    cache_dir = Path(tempfile.mkdtemp(prefix="mlxe-spill-"))  # ~1.2 GB of entries: removed at the end
    engine_args = ["--decode-concurrency", "8", "--prompt-cache-dir", str(cache_dir), "--prompt-cache-size", "1",
                   *args.engine_args.split()]
    try:
        with our_stack(model, engine_args) as (base, engine):
            result = asyncio.run(run(base, str(model), {**NO_PENALTY, **no_eos(model)}, args))
            log = engine.log()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    start, end = result.pop("window")
    steps = [step for step in engine_steps(log) if start <= step[0] <= end]
    periods = [b[0] - a[0] for a, b in zip(steps, steps[1:])]
    # The engine's time between two steps (admission, sharing a prompt's KV, evictions): a period less its step.
    between = sorted((b[0] - a[0]) * 1000 - b[1] for a, b in zip(steps, steps[1:]))
    result["engine_worst_period_ms"] = max(periods) * 1000 if periods else None
    result["engine_between_steps_ms"] = {"p50": statistics.median(between), "top3": between[-3:]}
    result["writes_logged"] = [line.split("prompt cache: ")[1] for line in log.splitlines() if "wrote" in line
                               and "prompt cache:" in line]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
