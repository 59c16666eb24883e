"""One engine vs two behind one front-end: aggregate tok/s, warm-turn TTFT, and the router's cost.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        flock /tmp/cpu.lock python bench/routing.py --size realistic

Each engine is pinned to one CPU core (`os.sched_setaffinity` in the child before it
starts, with OPENBLAS_NUM_THREADS=1), so "two engines" means two cores of work where
"one engine" had one; the gunicorn front-end (2 workers) is not pinned in either run.
The load: `--conversations` conversations, `--concurrency` at a time, each of
`--turns` streamed greedy turns (a ~`--prompt-words` first turn, then short follow-ups
that find their prefix in the engine's cache: the router keeps a conversation on one
engine). Reported: completion tokens / wall time over the whole load, and the TTFT
of the warm turns (2 and later), client clock. Then a microbenchmark of the routing
decision (affinity key + `EnginePool.choose`) in µs per request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scenarios import NO_PENALTY, words  # noqa: E402
from stack import bench_model  # noqa: E402

from tests.helpers import Frontend, engine_env, ping_engine  # noqa: E402


def start_engine(endpoint: str, model: Path, core: int, log: Path) -> subprocess.Popen:
    """`engined` pinned to one core (its threads inherit the mask), single-threaded BLAS."""
    env = engine_env({"OPENBLAS_NUM_THREADS": "1"})
    argv = [sys.executable, "-m", "engine_daemon", "--endpoint", endpoint, "--model", str(model),
            "--prompt-cache-size", "64"]
    pin = (lambda: os.sched_setaffinity(0, {core})) if hasattr(os, "sched_setaffinity") else None
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, preexec_fn=pin)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        pong = ping_engine(endpoint, 0.5)
        if pong and pong["state"] == "ready":
            return proc
        time.sleep(0.2)
    raise TimeoutError(f"engine at {endpoint} not ready")


async def turn(http, base: str, model: str, messages: list[dict], max_tokens: int, key: str):
    """(TTFT, completion tokens, text, engine id) of one streamed turn."""
    import json

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **NO_PENALTY}
    started, ttft, usage, text = time.perf_counter(), None, None, []
    async with http.stream("POST", f"{base}/chat/completions", json=body,
                           headers={"X-Session-Affinity": key}) as response:
        engine = response.headers.get("x-engine-id", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft or time.perf_counter() - started
                text.append(chunk["choices"][0]["delta"]["content"])
    return ttft, usage["completion_tokens"], "".join(text), engine, usage["prompt_tokens_details"]["cached_tokens"]


async def load(base: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    import httpx

    gate = asyncio.Semaphore(args.concurrency)
    warm_ttfts: list[float] = []
    tokens, cached, engines = 0, 0, Counter()

    async def conversation(index: int) -> None:
        nonlocal tokens, cached
        messages = [{"role": "system", "content": f"You are assistant {seed}-{index}."},
                    {"role": "user", "content": words(args.prompt_words, seed * 1000 + index)}]
        async with gate, httpx.AsyncClient(timeout=1800) as http:
            for number in range(args.turns):
                ttft, completion, text, engine, hit = await turn(http, base, model, messages, args.max_tokens,
                                                                 f"{seed}-{index}")
                tokens += completion
                engines[engine] += 1
                if number:
                    warm_ttfts.append(ttft)
                    cached += hit
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]

    started = time.perf_counter()
    await asyncio.gather(*(conversation(i) for i in range(args.conversations)))
    wall = time.perf_counter() - started
    warm_ttfts = sorted(warm_ttfts) or [0.0]  # the warm-up load has first turns only
    return {"tok_s": tokens / wall, "wall": wall, "tokens": tokens, "engines": dict(engines),
            "warm_ttft_p50": statistics.median(warm_ttfts), "warm_ttft_p90": warm_ttfts[int(0.9 * len(warm_ttfts))],
            "warm_cached_tokens": cached}


def run_config(n: int, model: Path, args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="mlxe-route-"))
    engines = []
    try:
        endpoints = [f"{name}=ipc://{work}/{name}.sock" for name in "ab"[:n]]
        for core, spec in enumerate(endpoints):
            engines.append(start_engine(spec.split("=", 1)[1], model, core, work / f"engined-{core}.log"))
        extra = [arg for spec in endpoints[1:] for arg in ("--endpoint", spec)]
        front = Frontend(endpoints[0], work / "frontend.log", workers=2, args=extra)
        try:
            front.wait_healthy()
            asyncio.run(load(f"{front.base_url}/v1", str(model),
                             argparse.Namespace(**{**vars(args), "conversations": n, "turns": 1}), seed=99))
            return asyncio.run(load(f"{front.base_url}/v1", str(model), args, seed=n))
        finally:
            front.stop()
    finally:
        for proc in engines:
            proc.terminate()
            proc.wait(30)


def routing_cost() -> dict:
    """µs per request: the affinity key of a realistic chat request, then the pool's choice."""
    from http_frontend.engine.pool import EnginePool, RouteHint
    from http_frontend.engine.routing import AFFINITY_HEADERS, affinity_key

    class Link:
        def __init__(self, load: int):
            self.frontend_id, self.streams, self.load, self.alive = "f", {}, load, True
            self.engine_state, self.model, self.routable = "ready", "m", True

    request = {"model": "m", "messages": [{"role": "system", "content": words(300, 1)},
                                          {"role": "user", "content": words(200, 2)},
                                          {"role": "assistant", "content": words(100, 3)},
                                          {"role": "user", "content": "Go on."}]}
    headers = {name: "" for name in AFFINITY_HEADERS}
    results = {}
    for n in (2, 4, 8):
        pool = EnginePool({f"e{i}": Link(i) for i in range(n)})
        counter = iter(range(10**9))

        def once() -> str:
            key = affinity_key(headers, engine_request=request)
            return pool.choose(RouteHint(f"{key}{next(counter)}", "m"))

        number = 20000
        results[n] = min(timeit.repeat(once, number=number, repeat=5)) / number * 1e6
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "realistic"])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    print(f"routing cost, µs per request (affinity key + choice): {routing_cost()}")
    model = bench_model(args.size)
    for n in (1, 2):
        result = run_config(n, model, args)
        print(f"{n} engine(s), one core each: {result['tok_s']:.1f} tok/s aggregate ({result['tokens']} tokens in "
              f"{result['wall']:.1f} s), warm-turn TTFT p50 {result['warm_ttft_p50'] * 1000:.0f} ms, "
              f"p90 {result['warm_ttft_p90'] * 1000:.0f} ms, warm cached tokens {result['warm_cached_tokens']}, "
              f"requests per engine {result['engines']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
