"""Speculative decoding (--draft-model): decode tok/s and acceptance, with and without a draft.

One streaming greedy request at a time (speculation serves lone requests) through the
full stack, on the random-weight model of Qwen2-0.5B shape. Drafts:

* none: the baseline;
* the model's first N blocks (model_builders/draft.py): a cheap draft of the
  same family with the same tokenizer. With random weights its agreement with the
  full model says little about a trained pair; it is what this machine can measure;
* the model itself: every draft token is accepted, the mechanism's upper bound on
  acceptance (and its cost: the draft is as slow as the model).

Every configuration must produce the same text (greedy output is the model's own).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/speculative.py --max-tokens 96 --runs 2

`--context-words` puts a document of that many words before the question, so the draft's and the
model's decode steps run at a long context (where the CPU's decode attention takes its NumPy path
past 16,384 scores a layer: compare `--engine-args "--cpu-decode-attention mlx"`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.stack import DEFAULT_MODELS, bench_model, our_stack  # noqa: E402

log = logging.getLogger("bench")
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper who finds a message in a "
             "bottle, with vivid details of the sea, the weather and the people of the village nearby."}]


def messages(context_words: int) -> list[dict]:
    """The question, after a document of `context_words` words when asked for one."""
    if not context_words:
        return MESSAGES
    from bench.scenarios import words

    return [{"role": "user", "content": words(context_words, seed=7) + "\n\n" + MESSAGES[0]["content"]}]


def one_stream(base_url: str, model: str, max_tokens: int, context_words: int = 0) -> dict:
    """Decode tok/s of one greedy stream (first token excluded), and its text."""
    # No repetition penalty: the model's generation_config sets 1.05; speculation is exact either way.
    body = {"model": model, "messages": messages(context_words), "max_tokens": max_tokens, "temperature": 0,
            "repetition_penalty": 1.0, "ignore_eos": True, "stream": True}
    first = last = None
    parts: list[str] = []
    with httpx.Client(timeout=1200) as http:
        start = time.perf_counter()
        with http.stream("POST", f"{base_url}/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    parts.append(chunk["choices"][0]["delta"]["content"])
    return {"ttft": first - start, "tps": (max_tokens - 1) / (last - first), "text": "".join(parts)}


def run_config(name: str, model: Path, engine_args: list[str], max_tokens: int, runs: int,
               context_words: int = 0) -> dict:
    log.info("%s ...", name)
    with our_stack(model, engine_args, workers=1) as (base_url, _engine):
        one_stream(base_url, str(model), 8, context_words)  # warm-up (and, with a context, its prefix cached)
        results = [one_stream(base_url, str(model), max_tokens, context_words) for _ in range(runs)]
        stats = httpx.get(base_url.removesuffix("/v1") + "/stats", timeout=30).json()
    spec = stats.get("speculative") or {}
    return {"name": name, "tps": statistics.median(r["tps"] for r in results),
            "ttft": statistics.median(r["ttft"] for r in results), "text": results[-1]["text"],
            "acceptance": spec.get("acceptance_rate"), "per_pass": spec.get("tokens_per_round"),
            "model_loads": stats["model_loads"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "small", "realistic"])
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[2],
                        help="drafts cut from the model's first N blocks (one run each)")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-self-draft", action="store_true", help="skip the draft = model run")
    parser.add_argument("--context-words", type=int, default=0, help="words of a document before the question")
    parser.add_argument("--engine-args", default="", help="extra engined flags for every run, space-separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if "LD_PRELOAD" not in os.environ:
        log.warning("LD_PRELOAD is not set: on Linux CPU this measures the slow reference BLAS")
    from model_builders.draft import build_truncated_draft

    model = bench_model(args.size)
    draft_args = ["--num-draft-tokens", str(args.num_draft_tokens)]
    configs = [("no draft", [])]
    for layers in args.draft_layers:
        draft = build_truncated_draft(model, DEFAULT_MODELS / f"{args.size}-qwen2-draft-{layers}l", layers)
        configs.append((f"first {layers} blocks as draft", ["--draft-model", str(draft), *draft_args]))
    if not args.no_self_draft:
        configs.append(("draft = the model itself", ["--draft-model", str(model), *draft_args]))
    rows = [run_config(name, model, [*engine_args, *args.engine_args.split()], args.max_tokens, args.runs,
                       args.context_words) for name, engine_args in configs]

    base = rows[0]
    print(f"\n{args.size} model, {args.max_tokens} new tokens, greedy, {args.num_draft_tokens} draft tokens, "
          f"median of {args.runs} runs, {args.context_words} words of context, engine args {args.engine_args!r}")
    print(f"{'':<28} {'decode tok/s':>12} {'vs none':>8} {'acceptance':>10} {'tokens/pass':>11} {'TTFT ms':>8} "
          f"{'same text':>9}")
    for row in rows:
        acceptance = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
        per_pass = f"{row['per_pass']:.2f}" if row["per_pass"] is not None else "-"
        print(f"{row['name']:<28} {row['tps']:>12.2f} {row['tps'] / base['tps']:>7.2f}x {acceptance:>10} "
              f"{per_pass:>11} {row['ttft'] * 1000:>8.0f} {str(row['text'] == base['text']):>9}")
    return 0 if all(row["text"] == base["text"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
