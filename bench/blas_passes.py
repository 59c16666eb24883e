"""What one forward pass's matrix products cost per row count under the BLAS this process has loaded.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/blas_passes.py --size small
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 BLIS_NUM_THREADS=2 python bench/blas_passes.py

`mlx[cpu]` multiplies matrices through whatever `cblas_sgemm` is loaded, so the preloaded BLAS
decides what a pass of a few rows costs beside one of hundreds. The long-prompt row turns on that
difference: a fused step pays a decode step plus its chunk's rows at the marginal cost per row, a
prompt sent alone pays the large-pass cost per row, so with steps of `r` decode steps the newcomer's
TTFT over its alone TTFT is about `r / (r - 1)` times their ratio (bench/README, section 8): only a
marginal row cheaper than a large pass's row beats `r / (r - 1)`. This script isolates that ratio
for the matrix products alone: the bench model's layer shapes (its `config.json`, weights drawn at
random, no model loaded), every layer's projections and MLP, the tied output head on the last 4
rows, evaluated layer by layer as the engine's CPU paths do. Rounds interleave the row counts so
that the machine's drift spreads over all of them.
Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

DECODE_ROWS = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--rows", default="32,64,96,128",
                        help="row counts of the small passes (the 4-row decode pass is always timed)")
    parser.add_argument("--large", type=int, default=512, help="the rows of a pass that stands for a prompt sent alone")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ratios", default="2.5,2.7,3.0", help="step sizes r (in decode steps) to evaluate")
    args = parser.parse_args()

    import mlx.core as mx
    from stack import bench_model

    mx.set_default_device(mx.cpu)
    config = json.loads((bench_model(args.size) / "config.json").read_text())
    hidden, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes = {"q": (hidden, hidden), "k": (hidden, kv), "v": (hidden, kv), "o": (hidden, hidden),
              "gate": (hidden, inner), "up": (hidden, inner), "down": (inner, hidden)}
    weights = [{name: mx.random.normal(shape) for name, shape in shapes.items()} for _ in range(layers)]
    head = mx.random.normal((hidden, config["vocab_size"]))
    mx.eval(weights, head)

    def forward(x: mx.array) -> None:
        for w in weights:
            parts = [x @ w["q"], x @ w["k"], x @ w["v"]]
            mixed = parts[0] @ w["o"]
            x = (x @ w["gate"] * (x @ w["up"])) @ w["down"] + mixed
            mx.eval(x, parts)
        mx.eval(x[-DECODE_ROWS:] @ head)

    rows = [int(value) for value in args.rows.split(",")]
    inputs = {m: mx.random.normal((m, hidden)) for m in [DECODE_ROWS, *rows, args.large]}
    mx.eval(list(inputs.values()))
    for x in inputs.values():
        forward(x)
    samples: dict[int, list[float]] = {m: [] for m in inputs}
    for _ in range(args.rounds):
        for m, x in inputs.items():
            started = time.perf_counter()
            forward(x)
            samples[m].append((time.perf_counter() - started) * 1000)
    ms = {m: statistics.median(values) for m, values in samples.items()}

    slope, base = statistics.linear_regression(rows, [ms[m] for m in rows])
    large_per_row = ms[args.large] / args.large
    decode = ms[DECODE_ROWS]
    print(f"{'rows':>5} {'pass ms':>8} {'ms/row':>7}")
    for m in inputs:
        print(f"{m:5d} {ms[m]:8.1f} {ms[m] / m:7.3f}")
    print(f"decode pass ({DECODE_ROWS} rows) {decode:.1f} ms; small passes = {base:.1f} ms + {slope:.3f} ms/row; "
          f"a {args.large}-row pass {large_per_row:.3f} ms/row; marginal / large = {slope / large_per_row:.2f}")
    for r in (float(value) for value in args.ratios.split(",")):
        chunk = (r * decode - base) / slope - DECODE_ROWS  # prompt rows a fused pass of r decode passes holds
        print(f"  fused passes of {r} decode passes hold {chunk:.0f} prompt rows: TTFT / alone "
              f"{r * decode / chunk / large_per_row:.2f} (matrix products only; r/(r-1) = {r / (r - 1):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
