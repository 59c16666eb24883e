"""lm-evaluation-harness itself, a few-shot multiple-choice task, against our stack with and without kept rows.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/lm_eval_fewshot.py --size small --questions 12

The real client (`lm_eval --model local-completions`, unmodified, its remote tokenizer: nothing downloads) on
a local JSON task: `--shots` examples drawn the same for every question (`first_n`), then the question and
four choices, so every request starts with the same examples and a question's four share the question too.
Our stack runs it twice: as shipped (a scored prompt's rows and KV kept, `ScoredPrefixes`) and with
`--prompt-cache-size 0` (nothing kept). Reported per run: lm-eval's wall time, the engine's computed and
reused positions (`/stats`), and the largest difference between the two runs' loglikelihoods.
Writes bench/results/lm_eval_fewshot-<size>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from scenarios import words  # noqa: E402
from stack import bench_model, our_stack  # noqa: E402

TASK = """task: engined_fewshot
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
    train: {train}
test_split: test
fewshot_split: train
num_fewshot: {shots}
fewshot_config:
  sampler: first_n
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
target_delimiter: " "
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def rows(count: int, seed: int) -> list[dict]:
    return [{"question": words(40, seed + i), "choices": [words(3 + c, seed + 100 * i + c) for c in range(4)],
             "answer": i % 4} for i in range(count)]


def run(base: str, model: str, tasks: Path, out: Path) -> dict:
    root = base.removesuffix("/v1")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LD_PRELOAD", None)  # the client computes nothing
    out.mkdir(parents=True, exist_ok=True)
    before = httpx.get(f"{root}/stats", timeout=30).json()
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"base_url={base}/completions,model={model},num_concurrent=1", "--tasks", "engined_fewshot",
         "--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "4"],
        cwd=out, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    after = httpx.get(f"{root}/stats", timeout=30).json()
    (samples,) = out.rglob("samples_engined_fewshot_*.jsonl")
    scores = [[float(score) for score, _ in json.loads(line)["filtered_resps"]]
              for line in samples.read_text().splitlines()]
    return {"seconds": seconds, "scores": scores,
            **{name: after[f"prompt_logprob_{name}"] - before[f"prompt_logprob_{name}"]
               for name in ("tokens", "reused_tokens", "requests")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--shots", type=int, default=5)
    args = parser.parse_args()
    model = bench_model(args.size)
    work = Path(tempfile.mkdtemp(prefix="lm-eval-bench-"))
    (work / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows(args.questions, 1)))
    (work / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows(args.shots, 900)))
    (work / "task.yaml").write_text(TASK.format(test=work / "test.jsonl", train=work / "train.jsonl",
                                                shots=args.shots))
    runs = {}
    for name, flags in (("kept", []), ("not kept", ["--prompt-cache-size", "0"])):
        with our_stack(model, ["--decode-concurrency", "8", *flags]) as (base, _engine):
            runs[name] = run(base, str(model), work, work / name.replace(" ", "-"))
        found = runs[name]
        print(f"{name}: lm-eval {found['seconds']:.1f} s for {found['requests']} requests; {found['tokens']} "
              f"positions computed, {found['reused_tokens']} reused", flush=True)
    kept, cold = runs["kept"], runs["not kept"]
    largest = max(abs(a - b) for qa, qb in zip(kept["scores"], cold["scores"], strict=True)
                  for a, b in zip(qa, qb, strict=True))
    print(f"kept / not kept: {cold['seconds'] / kept['seconds']:.2f}x faster; largest loglikelihood difference "
          f"{largest:.2e}")
    out = HERE / "results" / f"lm_eval_fewshot-{args.size}.json"
    summary = {name: {k: v for k, v in found.items() if k != "scores"} for name, found in runs.items()}
    out.write_text(json.dumps({"size": args.size, "questions": args.questions, "shots": args.shots,
                               "largest_difference": largest, "runs": summary}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
