"""One wave: eight requests at once on an idle server, from the first step until all eight stream.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/wave.py --size realistic --waves 3

Where the throughput benchmark (`compare.py`) spends its time between decode steps, read from
each server's own step trace (ours: the engine's `MLX_ENGINE_LOG_LEVEL=DEBUG` step log;
mlx_lm.server: `mlx_lm_steps.py`): for each wave, the steps and seconds from the start of the
wave's first step to the start of the first step that decodes all eight, and the median step
that decodes eight with nothing to prefill (end to end, so what a server does between steps counts).
Client-side TTFT is printed for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import format_summary, run_load  # noqa: E402
from stack import bench_model, mlx_lm_server, our_stack  # noqa: E402

HERE = Path(__file__).resolve().parent
OURS = re.compile(r"^(\S+ \S+) DEBUG .*step ([\d.]+) ms: (\d+) decoding, (\d+) prompt tokens", re.M)
THEIRS = re.compile(r"^([\d.]+) step ([\d.]+) ms: (\d+) decoding, (\d+) prefilling, (\d+) waiting", re.M)


def our_steps(text: str) -> list[tuple[float, float, int, bool]]:
    """(end time, seconds, decoding, prefilled anything) per step of our engine's log."""
    steps = []
    for stamp, ms, decoding, prompt in OURS.findall(text):
        end = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        steps.append((end, float(ms) / 1000, int(decoding), int(prompt) > 0))
    return steps


def their_steps(text: str) -> list[tuple[float, float, int, bool]]:
    return [(float(end), float(ms) / 1000, int(decoding), int(prefilling) + int(waiting) > 0)
            for end, ms, decoding, prefilling, waiting in THEIRS.findall(text)]


def wave_summary(steps: list[tuple[float, float, int, bool]], clients: int) -> dict:
    """Steps and seconds until every request decodes, and the median full decode step, of one wave."""
    first_full = next((i for i, step in enumerate(steps) if step[2] >= clients), len(steps))
    start = steps[0][0] - steps[0][1]
    until = steps[first_full][0] - steps[first_full][1] if first_full < len(steps) else steps[-1][0]
    # Step to step (end to end), so work a server does between its steps counts, as its clients see it.
    decode = [end - steps[i - 1][0] for i, (end, _, decoding, prefill) in enumerate(steps)
              if i and decoding >= clients and not prefill and steps[i - 1][2] >= clients]
    return {"steps_until_all_decode": first_full, "seconds_until_all_decode": until - start,
            "decode_step_ms": statistics.median(decode) * 1000 if decode else None}


def run(name: str, base: str, model: str, read_log, args: argparse.Namespace, extra: dict) -> list[dict]:
    asyncio.run(run_load(base, model, 1, 1, 16, 4, extra_body=extra, seed=1000))  # warm-up
    waves = []
    for wave in range(args.waves):
        offset = len(read_log())
        result = asyncio.run(run_load(base, model, args.clients, args.clients, args.prompt_tokens, args.max_tokens,
                                      extra_body=extra, seed=100 + wave))
        parse = our_steps if name == "ours" else their_steps
        summary = wave_summary(parse(read_log()[offset:]), args.clients)
        summary["ttft_p50_s"] = result["ttft_p50"]
        print(f"{name:<14} wave {wave + 1}: all {args.clients} decode after {summary['steps_until_all_decode']} "
              f"steps, {summary['seconds_until_all_decode']:.2f} s; decode step of {args.clients} "
              f"{summary['decode_step_ms']:.1f} ms; {format_summary(name, result)}", flush=True)
        waves.append(summary)
    return waves


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "small", "realistic"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--engine-args", default="", help="extra engined flags, space-separated")
    parser.add_argument("--skip-mlx-lm", action="store_true")
    args = parser.parse_args()
    model = bench_model(args.size)
    concurrency = ["--decode-concurrency", str(args.clients)]
    os.environ["MLX_ENGINE_LOG_LEVEL"] = "DEBUG"
    with our_stack(model, concurrency + args.engine_args.split()) as (base, engine):
        ours = run("ours", base, str(model), engine.log, args, {"repetition_penalty": 1.0})
    results = {"ours": ours}
    if not args.skip_mlx_lm:
        trace = Path(tempfile.mkdtemp(prefix="mlxlm-steps-")) / "steps.log"
        trace.touch()
        launcher = [str(HERE / "mlx_lm_steps.py"), "--step-log", str(trace)]
        with mlx_lm_server(model, concurrency, launcher=launcher) as base:
            results["mlx_lm.server"] = run("mlx_lm.server", base, str(model), trace.read_text, args, {})
    for name, waves in results.items():
        seconds = [w["seconds_until_all_decode"] for w in waves]
        print(f"{name:<14} median over {len(waves)} waves: all decode after {statistics.median(seconds):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
