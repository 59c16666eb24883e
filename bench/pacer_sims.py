"""`PrefillPacer` on modelled step costs: the chunks a 1,536-token prompt beside 4 streams is prefilled in.

    python bench/pacer_sims.py [--prompts 3] [--seeds 6]

No model and no engine: each case models what a step carrying a chunk of `c` prompt tokens
costs on top of the decode step, from measurements (bench/README section 8): a GPU's
dispatch-bound steps (a floor plus a little per token, random 2-3x spikes, a chunk size's first
step dearer while its kernels compile), and a CPU's compute-bound ones (a cost per token with
+-20% noise, growing with the prompt's context). Prints, per case, the steps and the largest
chunk of the last of `--prompts` prompts paced by one pacer, for each seed: how a change to the
pacer moves them (run it before and after).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine_daemon.scheduling.prefill_pacer import ROW_TILE, PrefillPacer  # noqa: E402

PROMPT, STREAMS = 1536, 4
Cost = Callable[[int, int], float]  # (chunk tokens, prompt tokens before it) -> seconds on top of the decode step


def gpu(floor: float, per_token: float, first_use: float) -> Cost:
    """A dispatch-bound step: `floor` + `per_token` a token, spikes, a size's first step `first_use`x dearer."""
    seen: set[int] = set()

    def cost(chunk: int, _done: int) -> float:
        spike = (1.0 if chunk in seen else first_use) * random.choice([1, 1, 1, 1, 1, 1, 2, 3])
        seen.add(chunk)
        return (floor + per_token * chunk) * spike * random.uniform(0.85, 1.3)
    return cost


def cpu(per_token: float, growth: float) -> Cost:
    """A compute-bound step: `per_token` a token at context 0, `growth`x that at the prompt's end, +-20%."""
    def cost(chunk: int, done: int) -> float:
        return per_token * (1 + (growth - 1) * done / PROMPT) * chunk * random.uniform(0.85, 1.25)
    return cost


CASES: dict[str, tuple[float, Callable[[], Cost]]] = {  # name: (decode step seconds, cost model)
    "gpu, 15 ms floor": (0.008, lambda: lambda chunk, done: 0.015 + 0.00001 * chunk),
    "gpu, 0.5B-like": (0.008, lambda: gpu(0.0045, 0.000035, 3.0)),
    "gpu, 0.5B-like, cold": (0.008, lambda: gpu(0.0045, 0.000035, 8.0)),
    "gpu, ~85M-like": (0.0045, lambda: gpu(0.002, 0.00002, 3.0)),
    "cpu, ~85M": (0.0475, lambda: cpu(0.00089, 1.0)),
    "cpu, ~85M, context 2.8x": (0.0475, lambda: cpu(0.0009, 2.8)),
    "cpu, 0.5B, context 2.3x": (0.187, lambda: cpu(0.0045, 2.3)),
}


def prefill(pacer: PrefillPacer, decode: float, cost: Cost) -> list[int]:
    """The chunks of one prompt, then a step with nothing waiting (the next prompt starts over)."""
    pacer.observe(decode, decoding=STREAMS, prompt_tokens=0)
    chunks, done = [], 0
    while done < PROMPT:
        chunk = min(pacer.chunk(STREAMS, 1), PROMPT - done)
        pacer.observe(decode + cost(chunk, done), decoding=STREAMS, prompt_tokens=chunk)
        chunks.append(chunk)
        done += chunk
    pacer.observe(decode, decoding=STREAMS, prompt_tokens=0, prefilling=0)
    return chunks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3, help="prompts paced by one pacer; the last is reported")
    parser.add_argument("--seeds", type=int, default=6)
    args = parser.parse_args()
    for name, (decode, model) in CASES.items():
        results = []
        for seed in range(args.seeds):
            random.seed(seed)
            pacer = PrefillPacer(None, maximum=2048, minimum=8, ratio=1.5, first=32, max_stall=1.0, tile=ROW_TILE)
            pacer.observe(0.030 if name.startswith("gpu") else 2.0, decoding=0, prompt_tokens=1500)  # alone, once
            cost = model()
            for _ in range(args.prompts):
                chunks = prefill(pacer, decode, cost)
            results.append(f"{len(chunks)} steps (max {max(chunks)})")
        print(f"{name:26s} " + ", ".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
