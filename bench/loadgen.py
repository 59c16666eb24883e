"""Load generator for any OpenAI-compatible server: N concurrent streaming chat clients.

Reports TTFT p50/p99, inter-token latency p50/p99, per-request and aggregate
generated tokens/s, and errors. Used on its own or by compare.py.

    python bench/loadgen.py --base-url http://127.0.0.1:8080/v1 --model default \
        --clients 8 --requests 8 --prompt-tokens 100 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain ocean forest city village market music "
         "story garden window light stone bridge letter voice dream winter summer morning evening").split()


@dataclass
class RequestResult:
    ok: bool
    started: float
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def decode_tps(self) -> float | None:
        if self.tokens < 2 or not self.chunk_times or self.end is None:
            return None
        span = self.chunk_times[-1] - self.chunk_times[0]
        return (self.tokens - 1) / span if span > 0 else None


def make_prompt(rng: random.Random, words: int, shared_prefix: list[str]) -> str:
    own = [rng.choice(WORDS) for _ in range(max(0, words - len(shared_prefix)))]
    return " ".join(shared_prefix + own)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[index]


async def one_request(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    result = RequestResult(ok=False, started=time.perf_counter())
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - result.started
                    result.chunk_times.append(now)
        result.end = time.perf_counter()
        result.ok = result.ttft is not None
        if not result.tokens:
            result.tokens = len(result.chunk_times)
    except Exception as exc:  # a benchmark counts errors, it does not stop at the first
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(base_url: str, model: str, clients: int, requests: int, prompt_tokens: int, max_tokens: int,
                   shared_prefix_ratio: float = 0.0, extra_body: dict[str, Any] | None = None, seed: int = 0,
                   prompts: list[str] | None = None) -> dict[str, Any]:
    """Runs `requests` streaming requests over `clients` concurrent connections; returns the summary."""
    rng = random.Random(seed)
    shared = [rng.choice(WORDS) for _ in range(int(prompt_tokens * shared_prefix_ratio))]
    prompts = prompts or [make_prompt(rng, prompt_tokens, shared) for _ in range(requests)]
    url = f"{base_url.rstrip('/')}/chat/completions"
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts[:requests]:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []

    async def client() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as http:
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, **(extra_body or {})}
                results.append(await one_request(http, url, body))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - started
    return summarize(results, wall)


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    itls = [gap for r in ok for gap in r.itls]
    per_request = [r.decode_tps for r in ok if r.decode_tps]
    latencies = [r.end - r.started for r in ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if not r.ok][:3],
        "wall_s": wall, "tokens": tokens, "aggregate_tps": tokens / wall if wall else 0.0,
        "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99),
        "latency_p50": percentile(latencies, 50), "latency_p99": percentile(latencies, 99),
        "per_request_tps_p50": statistics.median(per_request) if per_request else None,
    }


def format_summary(name: str, s: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return f"{v * 1000:8.0f}" if v is not None else "       -"

    return (f"{name:<34} ok {s['ok']:>3}/{s['requests']:<3} agg {s['aggregate_tps']:7.2f} tok/s  "
            f"per-req {s['per_request_tps_p50'] or 0:6.2f} tok/s  "
            f"TTFT p50/p99 {ms(s['ttft_p50'])}/{ms(s['ttft_p99'])} ms"
            f"  ITL p50/p99 {ms(s['itl_p50'])}/{ms(s['itl_p99'])} ms  latency p99 {ms(s['latency_p99'])} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default="default")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=100, help="approximate: words of prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shared-prefix-ratio", type=float, default=0.0)
    parser.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    summary = asyncio.run(run_load(args.base_url, args.model, args.clients, args.requests, args.prompt_tokens,
                                   args.max_tokens, args.shared_prefix_ratio, args.extra_body))
    print(json.dumps(summary, indent=2) if args.json else format_summary("load", summary))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
