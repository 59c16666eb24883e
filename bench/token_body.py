"""A stream's longest gap while 13 MB token-id prompts arrive on its front-end worker.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/token_body.py --runs 2

One gunicorn worker, the tiny model. A victim streams a completion; a second client posts, one after
another, `--bodies` completions whose prompt is `--ids` token ids written as single digits (13 MB of
JSON at 6.5 M ids; the model's window refuses them: 400 `context_length_exceeded`). Every C call the
worker makes on such a body (parsing, checking, packing) holds its GIL for the whole call, and the
victim's tokens wait. Prints each post's latency, the victim's longest gaps (client clock), and the
engine's longest gaps between two of the victim's decode steps (CALL `step_gaps`, the engine's clock):
a frame the engine's io thread spends long on delays every stream of every front-end, where the
worker's own parsing delays only that worker's.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stack import bench_model, our_stack  # noqa: E402

from tests.helpers import call_engine  # noqa: E402


async def victim(client: httpx.AsyncClient, url: str, model: str, arrivals: list[float], stop: asyncio.Event) -> None:
    body = {"model": model, "prompt": "hello", "max_tokens": 100_000, "stream": True, "ignore_eos": True,
            "temperature": 0}  # greedy: this prompt never falls into a run of tokens without text
    async with client.stream("POST", url + "/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                arrivals.append(time.perf_counter())
            if stop.is_set():
                break


async def run(ids: int, bodies: int) -> None:
    with our_stack(bench_model("tiny"), workers=1) as (url, engine):
        async with httpx.AsyncClient(timeout=120) as client:
            model = (await client.get(url + "/models")).json()["data"][0]["id"]
            raw = json.dumps({"model": model, "prompt": [i % 10 for i in range(ids)], "max_tokens": 1},
                             separators=(",", ":")).encode()
            arrivals: list[float] = []
            stop = asyncio.Event()
            task = asyncio.create_task(victim(client, url, model, arrivals, stop))
            await asyncio.sleep(3)
            start, posts = time.perf_counter(), []
            steps_before = call_engine(engine.endpoint, "step_gaps")["count"]
            for _ in range(bodies):
                sent = time.perf_counter()
                answer = await client.post(url + "/completions", content=raw,
                                           headers={"content-type": "application/json"})
                posts.append(f"{time.perf_counter() - sent:.2f} s ({answer.status_code})")
                await asyncio.sleep(0.5)
            await asyncio.sleep(1)
            answer = call_engine(engine.endpoint, "step_gaps")
            new_steps = answer["count"] - steps_before
            engine_gaps = sorted(answer["gaps_ms"][-new_steps:] if new_steps > 0 else [], reverse=True)
            stop.set()
            await task
            gaps = sorted((b - a for a, b in zip(arrivals, arrivals[1:]) if a > start - 1), reverse=True)
            events = sum(a > start for a in arrivals)
            print(f"{len(raw) / 1e6:.1f} MB bodies: posts {', '.join(posts)}; victim's longest gaps ({events} events "
                  "since the first post) "
                  f"{', '.join(f'{g * 1000:.0f}' for g in gaps[:3])} ms; engine's longest step gaps "
                  f"{', '.join(f'{g:.0f}' for g in engine_gaps[:3])} ms (median "
                  f"{engine_gaps[len(engine_gaps) // 2] if engine_gaps else float('nan'):.0f}, {new_steps} steps)",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=6_500_000)
    parser.add_argument("--bodies", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.runs):
        asyncio.run(run(args.ids, args.bodies))


if __name__ == "__main__":
    main()
