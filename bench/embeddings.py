"""A chat stream's pace while 50 embedding requests are served beside it (issue #19's interference figure).

One engine holds the chat model and an embedding model (its own slot). A greedy stream runs;
once it is steady, 50 /v1/embeddings requests (each several RAG-sized chunks) are sent by a few
concurrent clients, in `--rounds` bursts each right after a steady window (so load from other
processes drifts over both alike). The stream's inter-token latency is read from the engine's own per-step
timing (CALL `step_gaps`: the gap between consecutive decode steps while a request runs, so
client and HTTP jitter do not count): p50 while steady, p99 while the embeddings are served,
and their ratio (target <= 2). Repeated for several `--aux-step-tokens` values.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/embeddings.py

Client-side SSE gaps are printed beside it for reference; figures go to bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.loadgen import percentile  # noqa: E402
from bench.stack import DEFAULT_MODELS, bench_model, our_stack  # noqa: E402
from model_builders.embedding import build_bert_embedding  # noqa: E402
from tests.helpers import call_engine  # noqa: E402

WORDS = ("river mountain city sea report quarter revenue engine model token stream batch latency memory "
         "vector search document chunk answer question retrieval index policy customer order").split()


class Stream(threading.Thread):
    """A long greedy chat stream; client-side timestamps of its SSE events."""

    def __init__(self, base: str, model: str, max_tokens: int):
        super().__init__(daemon=True)
        self.base, self.model, self.max_tokens = base, model, max_tokens
        self.stamps: list[float] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Tell a long story"}],
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/chat/completions", json=body, timeout=600) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.stamps.append(time.monotonic())
                    if self.stop.is_set():
                        break
        except Exception as exc:  # reported, never raised from the thread
            self.error = repr(exc)


def gaps_since(endpoint: str, count: int) -> tuple[int, list[float]]:
    """(the engine's step count now, the gaps (ms) recorded after `count`)."""
    answer = call_engine(endpoint, "step_gaps")
    new = answer["count"] - count
    return answer["count"], answer["gaps_ms"][-new:] if new > 0 else []


def wait_for_gaps(endpoint: str, count: int, wanted: int, timeout: float = 600) -> tuple[int, list[float]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now, gaps = gaps_since(endpoint, count)
        if len(gaps) >= wanted:
            return now, gaps
        time.sleep(1.0)  # each poll is a new DEALER: keep the engine log quiet
    raise TimeoutError("the stream did not reach its steady window")


def chunk(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def run_one(chat: Path, embedder: Path, step_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of (a steady window, then a burst of embedding requests), so load drift hits both alike."""
    engine_args = ["--embedding-model", str(embedder), "--aux-step-tokens", str(step_tokens)]
    with our_stack(chat, engine_args) as (base, engine):
        rng = random.Random(0)
        httpx.post(f"{base}/embeddings", json={"input": [chunk(rng, args.words)] * args.inputs}, timeout=120)
        start, _ = gaps_since(engine.endpoint, 0)
        stream = Stream(base, str(chat), args.max_tokens)
        stream.start()
        count, _ = wait_for_gaps(engine.endpoint, start, 20)  # past the prefill and first steps
        steady: list[float] = []
        during: list[float] = []
        client: list[float] = []
        answers: list[httpx.Response] = []
        served = 0.0
        per_round = [args.requests // args.rounds + (r < args.requests % args.rounds) for r in range(args.rounds)]
        for requests in per_round:
            count, gaps = wait_for_gaps(engine.endpoint, count, args.steady_tokens // args.rounds)
            steady += gaps
            first_event = len(stream.stamps)
            # base64, as the openai SDK asks by default (float lists cost the front-end and client JSON work)
            bodies = [{"model": "any", "input": [chunk(rng, args.words) for _ in range(args.inputs)],
                       "encoding_format": args.encoding_format} for _ in range(requests)]
            started = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                answers += pool.map(lambda b: httpx.post(f"{base}/embeddings", json=b, timeout=600), bodies)
            served += time.monotonic() - started
            count, gaps = gaps_since(engine.endpoint, count)
            during += gaps
            stamps = stream.stamps[first_event:]
            client += [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
        stream.stop.set()
        stats = httpx.get(f"{base.removesuffix('/v1')}/stats", timeout=30).json()
    ok = sum(a.status_code == 200 for a in answers)
    tokens = sum(a.json()["usage"]["prompt_tokens"] for a in answers if a.status_code == 200)
    p50, p99 = percentile(steady, 50), percentile(during, 99)
    return {"aux_step_tokens": step_tokens, "requests_ok": ok, "embedding_tokens": tokens,
            "embeddings_seconds": round(served, 2), "embedding_tokens_per_s": round(tokens / served),
            "steady_steps": len(steady), "steps_during": len(during),
            "steady_itl_p50_ms": round(p50, 1), "steady_itl_p99_ms": round(percentile(steady, 99), 1),
            "during_itl_p50_ms": round(percentile(during, 50), 1), "during_itl_p99_ms": round(p99, 1),
            "ratio_p99_during_over_p50_steady": round(p99 / p50, 2),
            "ratio_p50_during_over_p50_steady": round(percentile(during, 50) / p50, 2),
            "ratio_p99_during_over_p99_steady": round(p99 / percentile(steady, 99), 2),
            "client_sse_gap_p99_ms_during": round(percentile(client, 99) or 0, 1),
            "model_loads": stats["model_loads"], "auxiliary_slices": stats["auxiliary_jobs"].get("slices"),
            "aux_ms_per_token": stats.get("aux_ms_per_token"),
            "shared_batches": stats["auxiliary_work"]["embedding"]["shared_batches"],
            "layer_slices": stats["auxiliary_work"]["embedding"].get("layer_slices"),
            "stream_error": stream.error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chat-size", default="realistic", help="model_builders.text size of the chat model")
    parser.add_argument("--embedder-size", default="minilm", help="model_builders.embedding BERT size")
    parser.add_argument("--step-tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--inputs", type=int, default=8, help="chunks per embedding request")
    parser.add_argument("--words", type=int, default=60, help="words per chunk")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--steady-tokens", type=int, default=120, help="steady decode steps, over all rounds")
    parser.add_argument("--rounds", type=int, default=3, help="steady window + burst pairs the requests split into")
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--encoding-format", choices=("base64", "float"), default="base64")
    parser.add_argument("--out", type=Path, help="also write the results here (JSON)")
    args = parser.parse_args()
    chat = bench_model(args.chat_size)
    embedder = build_bert_embedding(DEFAULT_MODELS / f"bert-{args.embedder_size}", size=args.embedder_size)
    results = []
    for step_tokens in args.step_tokens:
        results.append(run_one(chat, embedder, step_tokens, args))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
