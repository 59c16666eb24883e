"""lm-evaluation-harness (`lm_eval`, its `local-completions` model), unmodified, against the real stack.

Its loglikelihood tasks (multiple choice) send `/v1/completions` with `echo`, `logprobs` 1 and a token
prompt, and read the prompt tokens' own logprobs back: their sum over the continuation, and whether
each is its position's top alternative (`is_greedy`). With no tokenizer named it finds ours over
`GET /tokenizer_info` and `/tokenize` (the "remote" backend), so nothing downloads. Tasks are local
JSON files; the answers are checked against a forward pass of the same model in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import Frontend

MC_TASK = """task: engined_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
target_delimiter: ""
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: engined_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""
CONTEXTS = ["The sky on a clear day is", "Water freezes at zero degrees", "A fox is an"]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model))

    def table(ids: list[int]) -> Any:
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def greedy(context: str, count: int) -> str:
        ids = tokenizer.encode(context, add_special_tokens=False)
        start = len(ids)
        for _ in range(count):
            ids.append(int(mx.argmax(table(ids)[-1]).item()))
        return tokenizer.decode(ids[start:])

    def loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
        context_ids = tokenizer.encode(context, add_special_tokens=False)
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        scores = table(whole)
        positions = range(len(context_ids) - 1, len(whole) - 1)
        total = sum(scores[i, whole[i + 1]].item() for i in positions)
        return total, all(int(mx.argmax(scores[i]).item()) == whole[i + 1] for i in positions)

    return greedy, loglikelihood


def run_lm_eval(frontend: Frontend, model_id: str, tasks: Path, task: str, out: Path,
                batch_size: int = 1) -> list[dict[str, Any]]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LD_PRELOAD", None)  # the client computes nothing
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"base_url={frontend.base_url}/v1/completions,model={model_id},num_concurrent=2", "--tasks", task,
         "--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", str(batch_size)],
        cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Using remote tokenizer backend" in done.stderr + done.stdout  # found ours: nothing downloaded
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def test_multiple_choice_loglikelihoods_equal_a_forward_pass(frontend: Frontend, model_id: str, reference: Any,
                                                             tmp_path: Path) -> None:
    greedy, loglikelihood = reference
    # Each question's first choice is the model's own greedy continuation (lm-eval must call it greedy), the
    # others are not.
    rows = [{"question": c, "choices": [greedy(c, 3), " blue", " engine room"], "answer": 0} for c in CONTEXTS]
    (tmp_path / "mc.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=tmp_path / "mc.jsonl"))
    before = httpx.get(f"{frontend.base_url}/stats", timeout=30).json()["prompt_logprob_reused_tokens"]
    # Batches of 4 requests: arrays of token prompts, each choice answering the prompt at its index.
    samples = run_lm_eval(frontend, model_id, tmp_path, "engined_mc", tmp_path / "out", batch_size=4)
    # A question's context is computed for one of its choices: the other two start after it (`ScoredPrefixes`).
    reused = httpx.get(f"{frontend.base_url}/stats", timeout=30).json()["prompt_logprob_reused_tokens"] - before
    contexts = [httpx.post(f"{frontend.base_url}/tokenize", json={"model": model_id, "prompt": context,
                                                                 "add_special_tokens": False}, timeout=30).json()
                for context in CONTEXTS]
    assert reused >= sum(2 * (len(tokens["tokens"]) - 1) for tokens in contexts), reused
    assert len(samples) == len(rows)
    checked = 0
    for sample in samples:
        for arguments, (score, is_greedy) in zip(sample["arguments"].values(), sample["filtered_resps"], strict=True):
            expected, expected_greedy = loglikelihood(arguments["arg_0"], arguments["arg_1"])
            assert float(score) == pytest.approx(expected, abs=1e-3), arguments
            assert (is_greedy == "True") == expected_greedy, arguments
            checked += 1
        first = sample["filtered_resps"][0]
        assert first[1] == "True"  # the greedy continuation
    assert checked == 3 * len(rows)


def test_generation_task_runs_end_to_end(frontend: Frontend, model_id: str, tmp_path: Path) -> None:
    rows = [{"question": f"Question {i}: what comes next?", "answer": "x"} for i in range(3)]
    (tmp_path / "gen.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=tmp_path / "gen.jsonl"))
    samples = run_lm_eval(frontend, model_id, tmp_path, "engined_gen", tmp_path / "out")
    assert len(samples) == 3 and all(isinstance(sample["filtered_resps"][0], str) for sample in samples)
