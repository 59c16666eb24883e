"""One streaming request through the full stack vs. mlx_lm.stream_generate in-process.

Same random-weight model (Qwen2-0.5B shape, float32), same prompt tokens, same
max_tokens, greedy. Prints time-to-first-token and decode tokens/s for both.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/single_stream.py --max-tokens 64 --runs 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers import Engine, Frontend  # noqa: E402  (real processes, as in the tests)

log = logging.getLogger("bench")
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper who finds a message in a "
             "bottle, with vivid details of the sea, the weather and the people of the village nearby."}]

IN_PROCESS = r"""
import json, sys, time
from mlx_lm import load, stream_generate
model_dir, max_tokens, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
messages = json.loads(sys.argv[4])
model, tokenizer = load(model_dir)
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
results = []
for run in range(runs + 1):  # the first run warms up
    start = time.perf_counter(); first = None; n = 0
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        if first is None:
            first = time.perf_counter()
        n = response.generation_tokens
    end = time.perf_counter()
    if run:
        decode_tps = (n - 1) / (end - first) if end > first else 0.0
        results.append({"ttft": first - start, "tokens": n, "decode_tps": decode_tps,
                        "prompt_tokens": len(prompt)})
print(json.dumps(results))
"""


def in_process(model_dir: Path, max_tokens: int, runs: int) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(model_dir), str(max_tokens), str(runs),
                          json.dumps(MESSAGES)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def through_stack(base_url: str, model: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "repetition_penalty": 1.0, "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    usage = None
    with httpx.Client(timeout=600) as http:
        start = time.perf_counter()
        with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    n = usage["completion_tokens"]
    return {"ttft": first - start, "tokens": n, "decode_tps": (n - 1) / (last - first) if last > first else 0.0,
            "prompt_tokens": usage["prompt_tokens"]}


def summarize(name: str, results: list[dict]) -> dict:
    ttft = statistics.median(r["ttft"] for r in results)
    tps = statistics.median(r["decode_tps"] for r in results)
    print(f"{name:<28} prompt {results[0]['prompt_tokens']:>4} tok  TTFT {ttft * 1000:8.1f} ms  "
          f"decode {tps:6.2f} tok/s  ({len(results)} runs, {results[0]['tokens']} tokens each)")
    return {"ttft": ttft, "tps": tps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "small", "realistic"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model-dir", type=Path,
                        default=Path.home() / ".cache" / "mlx-engined" / "bench-models")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from model_builders.text import build_model

    model_dir = build_model(args.model_dir / f"{args.size}-qwen2", size=args.size)
    if "LD_PRELOAD" not in os.environ:
        log.warning("LD_PRELOAD is not set: on Linux CPU this measures the slow reference BLAS")

    log.info("in-process mlx_lm.stream_generate ...")
    reference = summarize("in-process stream_generate", in_process(model_dir, args.max_tokens, args.runs))

    work = Path(tempfile.mkdtemp(prefix="mlxe-bench-"))
    # No prefix cache: every run repeats the prompt, and in-process has no cache to hit either.
    engine = Engine(f"ipc://{work}/e.sock", work / "engined.log", model=str(model_dir),
                    args=["--prompt-cache-size", "0"])
    frontend = Frontend(engine.endpoint, work / "frontend.log", workers=2)
    try:
        engine.wait_ready(timeout=300)
        frontend.wait_healthy()
        through_stack(frontend.base_url, str(model_dir), args.max_tokens)  # warm-up
        ours = summarize("engined+frontend (HTTP/SSE)",
                         [through_stack(frontend.base_url, str(model_dir), args.max_tokens) for _ in range(args.runs)])
    finally:
        frontend.stop()
        engine.stop()
    print(f"ratio decode tok/s (ours / in-process): {ours['tps'] / reference['tps']:.3f}; "
          f"TTFT overhead: {(ours['ttft'] - reference['ttft']) * 1000:+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
