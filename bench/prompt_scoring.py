"""A prompt's own logprobs (`echo` + `logprobs`, what lm-evaluation-harness scores): their cost, and the streams beside.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/prompt_scoring.py --size small --trials 3

Per trial, on our stack (fresh text each time, so no prefix cache helps):
- alone: a ~1,500-token prompt prefilled for one token (`max_tokens` 1), and another scored
  (`echo`, `logprobs` 1, `max_tokens` 0), each by itself: what the logits of every position cost;
- beside streams: four chat streams decode, and after a steady period a third prompt is scored;
  the streams' worst gap during it over their steady median (the pacing target is 3x) on the engine's
  clock (CALL `step_gaps`: between two decode steps) and as this client saw their chunks (that also
  counts the front-end's and this process's own work on the scored answer), and the scoring's time
  over its alone time, with the engine's slices (`/stats` `prompt_logprob_slices`, and `_riding_slices`: those
  that rode in the streams' decode steps).
Writes bench/results/prompt_scoring-<size>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from loadgen import one_request  # noqa: E402
from prefix_burst import warm_up  # noqa: E402
from prompt_scenarios import no_eos  # noqa: E402
from scenarios import NO_PENALTY, words  # noqa: E402
from stack import bench_model, our_stack  # noqa: E402

from tests.helpers import call_engine  # noqa: E402


async def timed_completion(http: httpx.AsyncClient, base: str, body: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    response = await http.post(f"{base}/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()


async def trial(base: str, endpoint: str, model: str, extra: dict, number: int, long_words: int, steady_s: float,
                decode_tokens: int) -> dict:
    seed = 1000 + 10 * number
    chat = f"{base}/chat/completions"

    def stream_body(i: int) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": words(100, seed + i)}],
                "max_tokens": decode_tokens, "temperature": 0, "stream": True, **extra}

    def scoring(text: str) -> dict:
        return {"model": model, "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0}

    async with httpx.AsyncClient(timeout=3600) as http:
        plain = {"model": model, "prompt": words(long_words, seed + 5), "max_tokens": 1, "temperature": 0}
        prefill_s, prefilled = await timed_completion(http, base, plain)
        alone_s, alone = await timed_completion(http, base, scoring(words(long_words, seed + 6)))
        before = (await http.get(f"{base.removesuffix('/v1')}/stats")).json()
        streams = [asyncio.create_task(one_request(http, chat, stream_body(i))) for i in range(4)]
        await asyncio.sleep(steady_s)
        steps = call_engine(endpoint, "step_gaps")
        started = time.perf_counter()
        beside_s, beside = await timed_completion(http, base, scoring(words(long_words, seed + 7)))
        ended = started + beside_s
        gaps = call_engine(endpoint, "step_gaps")
        after = (await http.get(f"{base.removesuffix('/v1')}/stats")).json()
        results = await asyncio.gather(*streams)
    steady, during = [], []
    for result in results:
        for a, b in zip(result.chunk_times, result.chunk_times[1:]):
            (steady if b < started else during if a < ended and b > started else []).append(b - a)
    median = statistics.median(steady)
    new = gaps["count"] - steps["count"]
    engine_steady = statistics.median(steps["gaps_ms"][-100:])
    engine_worst = max(gaps["gaps_ms"][-new:]) if new > 0 else float("nan")

    def per_token(seconds: float, answer: dict) -> float:
        return seconds / answer["usage"]["prompt_tokens"]

    return {"prompt_tokens": beside["usage"]["prompt_tokens"], "alone_prefill_s": prefill_s,
            "alone_prefill_tokens": prefilled["usage"]["prompt_tokens"], "alone_scoring_s": alone_s,
            "alone_scoring_tokens": alone["usage"]["prompt_tokens"], "beside_scoring_s": beside_s,
            "scoring_over_prefill": per_token(alone_s, alone) / per_token(prefill_s, prefilled),
            "beside_over_alone": per_token(beside_s, beside) / per_token(alone_s, alone),
            "engine_steady_gap_ms": engine_steady, "engine_worst_gap_ms": engine_worst,
            "engine_gap_ratio": engine_worst / engine_steady, "engine_steps_during": new,
            "steady_gap_ms": median * 1000, "worst_gap_ms": max(during) * 1000, "gap_ratio": max(during) / median,
            "gaps_during": len(during), "slices": after["prompt_logprob_slices"] - before["prompt_logprob_slices"],
            "riding_slices": after["prompt_logprob_riding_slices"] - before["prompt_logprob_riding_slices"],
            "streams_ok": all(r.ok for r in results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--long-words", type=int, default=1000, help="~1,500 tokens")
    parser.add_argument("--steady-seconds", type=float, default=6.0)
    parser.add_argument("--decode-tokens", type=int, default=600)
    args = parser.parse_args()
    model = bench_model(args.size)
    extra = {**NO_PENALTY, **no_eos(model)}
    with our_stack(model, ["--decode-concurrency", "8"]) as (base, engine):
        asyncio.run(warm_up(base, str(model), dict(NO_PENALTY)))
        trials = [asyncio.run(trial(base, engine.endpoint, str(model), extra, n, args.long_words, args.steady_seconds,
                                    args.decode_tokens)) for n in range(args.trials)]
    for n, found in enumerate(trials):
        print(f"trial {n}: {found['prompt_tokens']} tokens; alone prefill {found['alone_prefill_s']:.2f} s, alone "
              f"scoring {found['alone_scoring_s']:.2f} s ({found['scoring_over_prefill']:.2f}x a prefill's time a "
              f"token); beside 4 streams {found['beside_scoring_s']:.2f} s ({found['beside_over_alone']:.2f}x alone, "
              f"{found['slices']} slices, {found['riding_slices']} in decode steps); streams' worst gap on the "
              f"engine's clock "
              f"{found['engine_gap_ratio']:.2f}x steady "
              f"({found['engine_worst_gap_ms']:.0f} / {found['engine_steady_gap_ms']:.1f} ms, "
              f"{found['engine_steps_during']} steps), as the client saw them {found['gap_ratio']:.2f}x "
              f"({found['worst_gap_ms']:.0f} / {found['steady_gap_ms']:.1f} ms)", flush=True)
    out = HERE / "results" / f"prompt_scoring-{args.size}.json"
    out.write_text(json.dumps({"size": args.size, "trials": trials}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
