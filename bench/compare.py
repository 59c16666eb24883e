"""Same model, same load: mlx_lm.server vs. our full HTTP stack, in one run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/compare.py --clients 8 --requests 16 --prompt-tokens 100 --max-tokens 128

Both servers get --decode-concurrency equal to --clients, greedy requests, and no
repetition penalty (mlx_lm.server ignores generation_config.json; ours would apply it).
With --rounds N both stay up and take turns, N loads each, fresh prompts every round
(so no prefix cache can reuse an earlier round), and the ratio of the pooled tokens/s
is printed with each round's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import format_summary, run_load  # noqa: E402
from stack import bench_model, mlx_lm_server, our_stack  # noqa: E402


def drive(base_url: str, model: str, args: argparse.Namespace, extra: dict, seed: int) -> dict:
    return asyncio.run(run_load(base_url, model, args.clients, args.requests, args.prompt_tokens,
                                args.max_tokens, args.shared_prefix_ratio, extra_body=extra, seed=seed))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "small", "realistic"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shared-prefix-ratio", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="loads per server, alternating which goes first; new prompts every round")
    parser.add_argument("--skip-mlx-lm", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="our front-end's gunicorn workers")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = bench_model(args.size)
    with ExitStack() as servers:
        # Both servers stay up for the whole run and take turns, so slow drift of the machine
        # (other tenants, heat) falls on both alike; only the one being driven does any work.
        bases = {}
        if not args.skip_mlx_lm:
            bases["mlx_lm.server"] = (servers.enter_context(
                mlx_lm_server(model, ["--decode-concurrency", str(args.clients)])), {})
        ours, _ = servers.enter_context(our_stack(model, ["--decode-concurrency", str(args.clients)],
                                                  workers=args.workers))
        bases["engined+frontend"] = (ours, {"repetition_penalty": 1.0})
        for base, extra in bases.values():
            asyncio.run(run_load(base, str(model), 1, 1, 16, 4, extra_body=extra, seed=1000))  # warm-up
        results: dict[str, list[dict]] = {name: [] for name in bases}
        for round_ in range(args.rounds):
            order = list(bases) if round_ % 2 == 0 else list(reversed(bases))
            for name in order:
                base, extra = bases[name]
                results[name].append(drive(base, str(model), args, extra, seed=round_))
                print(f"round {round_ + 1} " + format_summary(name, results[name][-1]), flush=True)
            if len(bases) == 2:
                ratio = (results["engined+frontend"][-1]["aggregate_tps"]
                         / results["mlx_lm.server"][-1]["aggregate_tps"])
                print(f"round {round_ + 1} aggregate tok/s ratio (ours / mlx_lm.server): {ratio:.3f}x", flush=True)
    totals = {name: sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs) for name, runs in results.items()}
    for name, tps in totals.items():
        print(f"all rounds {name:<20} {tps:7.2f} tok/s")
    if len(totals) == 2:
        print(f"all rounds aggregate tok/s ratio (ours / mlx_lm.server): "
              f"{totals['engined+frontend'] / totals['mlx_lm.server']:.3f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
