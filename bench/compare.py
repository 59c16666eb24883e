"""Same model, same load: mlx_lm.server vs. our full HTTP stack, in one run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/compare.py --clients 8 --requests 16 --prompt-tokens 100 --max-tokens 128

Both servers get --decode-concurrency equal to --clients, greedy requests, and no
repetition penalty (mlx_lm.server ignores generation_config.json; ours would apply it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import format_summary, run_load  # noqa: E402
from stack import bench_model, mlx_lm_server, our_stack  # noqa: E402


def drive(base_url: str, model: str, args: argparse.Namespace, extra: dict) -> dict:
    asyncio.run(run_load(base_url, model, 1, 1, 16, 4, extra_body=extra))  # warm-up
    return asyncio.run(run_load(base_url, model, args.clients, args.requests, args.prompt_tokens,
                                args.max_tokens, args.shared_prefix_ratio, extra_body=extra))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "realistic"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shared-prefix-ratio", type=float, default=0.0)
    parser.add_argument("--skip-mlx-lm", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="our front-end's gunicorn workers")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = bench_model(args.size)
    results = {}
    if not args.skip_mlx_lm:
        with mlx_lm_server(model, ["--decode-concurrency", str(args.clients)]) as base:
            results["mlx_lm.server"] = drive(base, str(model), args, {})
        print(format_summary("mlx_lm.server", results["mlx_lm.server"]), flush=True)
    with our_stack(model, ["--decode-concurrency", str(args.clients)], workers=args.workers) as (base, _):
        results["engined+frontend"] = drive(base, str(model), args, {"repetition_penalty": 1.0})
    print(format_summary("engined+frontend", results["engined+frontend"]), flush=True)
    if "mlx_lm.server" in results:
        ratio = results["engined+frontend"]["aggregate_tps"] / results["mlx_lm.server"]["aggregate_tps"]
        print(f"aggregate tok/s ratio (ours / mlx_lm.server): {ratio:.2f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
