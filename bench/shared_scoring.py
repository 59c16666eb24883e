"""Scoring prompts that share their start (lm-evaluation-harness's multiple choice after few-shot examples).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/shared_scoring.py --size small --questions 6

Every question is the same few-shot examples (~`--shots` x 100 words), then its own question and four
choices. Each choice is one request as lm-eval's `local-completions` sends it (a token prompt, `echo`,
`logprobs` 1, `max_tokens` 1); a question's four go together, the questions one after another. Our
stack runs the same requests twice: as shipped (a scored prompt's rows and KV kept, `ScoredPrefixes`),
and with `--prompt-cache-size 0` (nothing kept: every prompt scored from its first token). Reported per
run: the wall time, the positions the engine computed and reused (`/stats`), and the largest difference
between the two runs' logprobs. Writes bench/results/shared_scoring-<size>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from prefix_burst import warm_up  # noqa: E402
from scenarios import NO_PENALTY, words  # noqa: E402
from stack import bench_model, our_stack  # noqa: E402

CHOICES = 4


async def tokens(http: httpx.AsyncClient, root: str, model: str, text: str) -> list[int]:
    response = await http.post(f"{root}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
    response.raise_for_status()
    return response.json()["tokens"]


async def prompts(http: httpx.AsyncClient, root: str, model: str, questions: int, shots: int) -> list[list[list[int]]]:
    """Per question, its choices' token prompts: the examples, the question, a choice (tokenized apart, as lm-eval)."""
    examples = "".join(f"Question: {words(80, 50 + i)}\nAnswer: {words(20, 70 + i)}\n\n" for i in range(shots))
    out = []
    for q in range(questions):
        context = await tokens(http, root, model, f"{examples}Question: {words(40, 100 + q)}\nAnswer:")
        out.append([context + await tokens(http, root, model, " " + words(4 + c, 200 + 10 * q + c))
                    for c in range(CHOICES)])
    return out


async def run(base: str, model: str, questions: list[list[list[int]]]) -> dict:
    root = base.removesuffix("/v1")

    async def score(ids: list[int]) -> list[float]:
        body = {"model": model, "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        response = await http.post(f"{base}/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]

    async with httpx.AsyncClient(timeout=3600) as http:
        before = (await http.get(f"{root}/stats")).json()
        started = time.perf_counter()
        answers = [await asyncio.gather(*(score(ids) for ids in choices)) for choices in questions]
        seconds = time.perf_counter() - started
        after = (await http.get(f"{root}/stats")).json()
    return {"seconds": seconds, "logprobs": answers,
            **{name: after[f"prompt_logprob_{name}"] - before[f"prompt_logprob_{name}"]
               for name in ("tokens", "reused_tokens", "slices", "requests")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--shots", type=int, default=5, help="few-shot examples, ~130 tokens each")
    args = parser.parse_args()
    model = bench_model(args.size)
    runs, questions = {}, None
    for name, flags in (("kept", []), ("not kept", ["--prompt-cache-size", "0"])):
        with our_stack(model, ["--decode-concurrency", "8", *flags]) as (base, _engine):
            asyncio.run(warm_up(base, str(model), dict(NO_PENALTY)))
            if questions is None:
                async def build() -> list[list[list[int]]]:
                    async with httpx.AsyncClient(timeout=600) as http:
                        return await prompts(http, base.removesuffix("/v1"), str(model), args.questions, args.shots)
                questions = asyncio.run(build())
            runs[name] = asyncio.run(run(base, str(model), questions))
    kept, cold = runs["kept"], runs["not kept"]
    differences = [abs(a - b) for qa, qb in zip(kept["logprobs"], cold["logprobs"]) for ca, cb in zip(qa, qb)
                   for a, b in zip(ca, cb)]
    total = sum(len(ids) - 1 for choices in questions for ids in choices)
    for name, found in runs.items():
        print(f"{name}: {found['seconds']:.2f} s for {found['requests']} prompts ({total} positions): "
              f"{found['tokens']} computed, {found['reused_tokens']} reused, {found['slices']} slices", flush=True)
    print(f"kept / not kept: {kept['seconds'] / cold['seconds']:.3f} of the time "
          f"({cold['seconds'] / kept['seconds']:.2f}x faster); largest logprob difference {max(differences):.2e}")
    out = HERE / "results" / f"shared_scoring-{args.size}.json"
    summary = {name: {k: v for k, v in found.items() if k != "logprobs"} for name, found in runs.items()}
    out.write_text(json.dumps({"size": args.size, "questions": args.questions, "shots": args.shots,
                               "prompt_tokens": [len(c[0]) for c in questions], "positions": total,
                               "largest_difference": max(differences), "runs": summary}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
