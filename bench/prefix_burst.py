"""Eight clients at once, one long shared system prompt: ours vs mlx_lm.server, one server at a time.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/prefix_burst.py --size realistic --rounds 2

Each round sends N requests at the same moment: the same ~1,500-token system prompt (new
every round, so no cache holds it yet) and a distinct ~20-token question, greedy, 16 new
tokens. Reported per server: the time until the last request's first token, and whether
every reply equals the same request sent alone afterwards (greedy: prefix sharing must not
change an answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenarios import NO_PENALTY, words  # noqa: E402
from stack import bench_model, mlx_lm_server, our_stack  # noqa: E402


async def first_token_and_text(http: httpx.AsyncClient, url: str, body: dict) -> tuple[float, str]:
    """Seconds to the first content chunk (from this call) and the whole text."""
    started, first, text = time.perf_counter(), None, []
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta:
                first = first or time.perf_counter() - started
                text.append(delta)
    return first or float("nan"), "".join(text)


def body(model: str, system: str, question: str, extra: dict) -> dict:
    return {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 16, "temperature": 0, "stream": True, **extra}


async def burst(base: str, model: str, clients: int, seed: int, extra: dict) -> dict:
    system = words(1000, 10_000 + seed)  # ~1,500 tokens, new every round
    questions = [words(14, 20_000 + 100 * seed + i) for i in range(clients)]
    url = f"{base}/chat/completions"
    async with httpx.AsyncClient(timeout=3600) as http:
        started = time.perf_counter()
        results = await asyncio.gather(*(first_token_and_text(http, url, body(model, system, q, extra))
                                          for q in questions))
        last_first = max(started + ttft for ttft, _ in results) - started
        alone = [await first_token_and_text(http, url, body(model, system, q, extra)) for q in questions]
    identical = sum(a[1] == b[1] for a, b in zip(results, alone))
    return {"last_first_token_s": last_first, "identical": identical, "clients": clients}


async def warm_up(base: str, model: str, extra: dict) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        await first_token_and_text(http, f"{base}/chat/completions", body(model, "warm up", "hi", extra))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "small", "realistic"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-mlx-lm", action="store_true")
    args = parser.parse_args()
    model = bench_model(args.size)
    servers = {"engined+frontend": lambda: our_stack(model, ["--decode-concurrency", str(args.clients)])}
    if not args.skip_mlx_lm:
        servers["mlx_lm.server"] = lambda: mlx_lm_server(model, ["--decode-concurrency", str(args.clients)])
    results: dict[str, list[dict]] = {}
    for name, start in servers.items():  # one server at a time: each has the machine to itself
        with start() as started:
            base = started[0] if isinstance(started, tuple) else started
            extra = NO_PENALTY if name == "engined+frontend" else {}
            asyncio.run(warm_up(base, str(model), extra))
            for round_ in range(args.rounds):
                result = asyncio.run(burst(base, str(model), args.clients, round_, extra))
                results.setdefault(name, []).append(result)
                print(f"{name:<18} round {round_ + 1}: last first token {result['last_first_token_s']:.1f} s, "
                      f"{result['identical']}/{result['clients']} replies identical to the request alone", flush=True)
    if len(results) == 2:
        ours = min(r["last_first_token_s"] for r in results["engined+frontend"])
        theirs = min(r["last_first_token_s"] for r in results["mlx_lm.server"])
        print(f"best of rounds: ours {ours:.1f} s, mlx_lm.server {theirs:.1f} s = {theirs / ours:.2f}x faster")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
