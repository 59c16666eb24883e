"""The engine's ceiling: mlx-lm's batch_generate in-process on the same workload as compare.py.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/batch_ceiling.py
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import WORDS  # noqa: E402
from stack import bench_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    from mlx_lm import batch_generate, load

    model, tokenizer = load(str(bench_model(args.size)))
    rng = random.Random(0)
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(args.prompt_tokens))}],
        add_generation_prompt=True) for _ in range(args.batch)]
    batch_generate(model, tokenizer, prompts[:1], max_tokens=4)  # warm-up
    started = time.perf_counter()
    response = batch_generate(model, tokenizer, prompts, max_tokens=args.max_tokens)
    wall = time.perf_counter() - started
    tokens = response.stats.generation_tokens
    print(f"batch_generate batch {args.batch}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.2f} tok/s "
          f"end to end (prefill {response.stats.prompt_tps:.1f} tok/s, "
          f"decode {response.stats.generation_tps:.2f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
