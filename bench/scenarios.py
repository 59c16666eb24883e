"""Engine scenarios on our stack: multi-turn prefix reuse, many clients, long prompt while decoding.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/scenarios.py multiturn
    ... python bench/scenarios.py many-clients      # 32 clients, --decode-concurrency 8
    ... python bench/scenarios.py long-prompt       # 4 decoding clients, then a 1,000-token prompt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import WORDS, format_summary, one_request, percentile, run_load  # noqa: E402
from stack import bench_model, our_stack, peak_rss_mb  # noqa: E402

NO_PENALTY = {"repetition_penalty": 1.0}


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def streamed_turn(base: str, model: str, messages: list[dict], max_tokens: int,
                        extra: dict | None = None) -> tuple[float, dict, str]:
    """TTFT, usage and text of one streamed chat turn (`extra`: more body fields; ours by default)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(NO_PENALTY if extra is None else extra)}
    ttft, usage, text = None, None, []
    async with httpx.AsyncClient(timeout=1800) as http:
        # The clock starts once the client exists: making one (its TLS context) costs 20-80 ms of client CPU,
        # more while a server computes on every core, and an agent keeps its client between turns.
        started = time.perf_counter()
        async with http.stream("POST", f"{base}/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - started
                    text.append(chunk["choices"][0]["delta"]["content"])
    return ttft, usage, "".join(text)


def multiturn(args: argparse.Namespace) -> None:
    model = bench_model(args.size)
    with our_stack(model) as (base, _):
        asyncio.run(streamed_turn(base, str(model), [{"role": "user", "content": "warm up"}], 4))
        for conversation in range(2):
            history = [{"role": "system", "content": "You are a careful assistant."},
                       {"role": "user", "content": words(args.history_words, conversation)}]
            ttft1, usage1, reply = asyncio.run(streamed_turn(base, str(model), history, 32))
            history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Summarize that."}]
            ttft2, usage2, _ = asyncio.run(streamed_turn(base, str(model), history, 32))
            cached = usage2["prompt_tokens_details"]["cached_tokens"]
            print(f"conversation {conversation}: turn 1 prompt {usage1['prompt_tokens']} tok "
                  f"TTFT {ttft1 * 1000:.0f} ms;"
                  f" turn 2 prompt {usage2['prompt_tokens']} tok, cached {cached}, TTFT {ttft2 * 1000:.0f} ms"
                  f" = {ttft2 / ttft1 * 100:.1f}% of cold", flush=True)


def many_clients(args: argparse.Namespace) -> None:
    model = bench_model(args.size)
    engine_args = ["--decode-concurrency", "8", "--memory-budget", str(args.memory_budget)]
    with our_stack(model, engine_args) as (base, engine):
        asyncio.run(run_load(base, str(model), 1, 1, 16, 4, extra_body=NO_PENALTY))
        summary = asyncio.run(run_load(base, str(model), args.clients, args.clients, args.prompt_tokens,
                                       args.max_tokens, extra_body={**NO_PENALTY, "ignore_eos": True}))
        rss = peak_rss_mb(engine.pid)
        stats = httpx.get(base.replace("/v1", "") + "/stats").json()
    print(format_summary(f"{args.clients} clients, decode-concurrency 8", summary))
    print(f"engine peak RSS {rss:.0f} MB (budget {args.memory_budget * 1024:.0f} MB); max batch "
          f"{stats['max_batch_size']}; rejections {stats['rejections']}; "
          f"latency p50/p99 {summary['latency_p50']:.1f}/{summary['latency_p99']:.1f} s")


async def long_prompt_run(base: str, model: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(timeout=1800) as http:
        url = f"{base}/chat/completions"

        def body(prompt: str, max_tokens: int) -> dict:
            return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, **NO_PENALTY}

        decoders = [asyncio.create_task(one_request(http, url, body(words(100, i), args.decode_tokens)))
                    for i in range(4)]
        await asyncio.sleep(args.steady_seconds)
        long_started = time.perf_counter()
        long_result = await one_request(http, url, body(words(args.long_words, 99), 8))
        long_first = long_started + long_result.ttft
        results = await asyncio.gather(*decoders)
    steady, during = [], []
    for r in results:
        for a, b in zip(r.chunk_times, r.chunk_times[1:]):
            if b < long_started:
                steady.append(b - a)
            elif a < long_first and b > long_started:
                during.append(b - a)
    p50, p99 = statistics.median(steady), percentile(during, 99)
    print(f"long prompt: {long_result.tokens} tokens out, TTFT {long_result.ttft * 1000:.0f} ms")
    print(f"running clients: steady ITL p50 {p50 * 1000:.0f} ms; during the long prefill ITL p99 "
          f"{p99 * 1000:.0f} ms ({len(during)} gaps) = {p99 / p50:.2f}x steady p50")


def long_prompt(args: argparse.Namespace) -> None:
    model = bench_model(args.size)
    engine_args = ["--interleave-prefill-tokens", str(args.interleave)]
    with our_stack(model, engine_args) as (base, _):
        asyncio.run(run_load(base, str(model), 1, 1, 16, 4, extra_body=NO_PENALTY))
        asyncio.run(long_prompt_run(base, str(model), args))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "small", "realistic"])
    sub = parser.add_subparsers(dest="scenario", required=True)
    p = sub.add_parser("multiturn")
    p.add_argument("--history-words", type=int, default=1330, help="~2,000 tokens of shared history")
    p = sub.add_parser("many-clients")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--memory-budget", type=float, default=4.0, help="GB")
    p = sub.add_parser("long-prompt")
    p.add_argument("--long-words", type=int, default=850, help="~1,000 tokens")
    p.add_argument("--decode-tokens", type=int, default=400)
    p.add_argument("--steady-seconds", type=float, default=8.0)
    p.add_argument("--interleave", type=int, default=0, help="0: paced by the engine")
    args = parser.parse_args()
    {"multiturn": multiturn, "many-clients": many_clients, "long-prompt": long_prompt}[args.scenario](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
