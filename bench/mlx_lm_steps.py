"""mlx_lm.server with a trace of its generation steps, for comparing step by step with our engine's log.

    python bench/mlx_lm_steps.py --step-log /tmp/mlx_lm-steps.log --model PATH --port 8080 [mlx_lm.server flags]

Every `BatchGenerator._next` call that had work is written as one line: a `time.perf_counter()`
stamp at its end, its duration, and how many sequences were decoding, being prefilled and
waiting when it began (`bench/wave.py` reads it). mlx_lm.server itself is unchanged.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

import mlx_lm.generate  # noqa: F401  (the module: `mlx_lm.generate` the name is its `generate` function)

generate_module = sys.modules["mlx_lm.generate"]


def trace_steps(out: TextIO) -> None:
    """Wraps `BatchGenerator._next` so each step with work is written to `out`."""
    original = generate_module.BatchGenerator._next

    def traced(self: Any) -> Any:
        decoding, prefilling = len(self._generation_batch), len(self._prompt_batch)
        waiting = len(self._unprocessed_sequences)
        started = time.perf_counter()
        result = original(self)
        ended = time.perf_counter()
        if decoding or prefilling or waiting:
            out.write(f"{ended:.4f} step {(ended - started) * 1000:.1f} ms: {decoding} decoding, "
                      f"{prefilling} prefilling, {waiting} waiting\n")
            out.flush()
        return result

    generate_module.BatchGenerator._next = traced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--step-log", required=True)
    ours, theirs = parser.parse_known_args()
    trace_steps(open(ours.step_log, "a"))
    from mlx_lm.server import main as server_main

    sys.argv = ["mlx_lm.server", *theirs]
    server_main()


if __name__ == "__main__":
    main()
