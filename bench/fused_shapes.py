"""What a fused step costs the first time its shapes are seen, and the chunk sizes a long prompt could take.

    python bench/fused_shapes.py --size realistic      # on a GPU: MLX CUDA or Metal

In process, on the engine's `fused_forward` beside 4 decoding streams, on the default
device: a ~1,500-token prompt walked in chunks of varying sizes (as the pacer takes them),
then the same walk again (every shape seen once), in chunks of fixed sizes, and prefilled
alone (one pass, and 512-token passes). On a GPU a step is bound by dispatching its kernels
rather than by computing, and a kernel compiled for a new shape costs the step that first
meets it: on an H100 the first walk took twice the second. Both shape what `PrefillPacer`
(its `CostFloor`) can do there. Writes bench/results/fused_shapes-<size>.json.
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
from stack import bench_model  # noqa: E402

STREAMS, STREAM_CONTEXT, PROMPT = 4, 300, 1536
VARYING = [32, 44, 60, 76, 92, 108, 124, 140]  # whole 16-row tiles beside 4 streams, as the pacer sizes them


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "small", "realistic"])
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine_daemon.generation.fused_step import fused_forward

    model, _tokenizer = load(str(bench_model(args.size)))
    vocab = model.args.vocab_size
    decode_cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, vocab, (STREAMS, STREAM_CONTEXT)), cache=decode_cache),
            [c.state for c in decode_cache])
    decode_tokens = mx.random.randint(0, vocab, (STREAMS, 1))
    mx.eval(decode_tokens)

    def decode() -> float:
        started = time.perf_counter()
        mx.eval(model(decode_tokens, cache=decode_cache))
        for c in decode_cache:
            c.trim(1)
        return time.perf_counter() - started

    def walk(sizes: list[int], fused: bool) -> list[tuple[int, int, float]]:
        """(chunk, context, ms) of each step prefilling a PROMPT-token prompt in chunks cycling through `sizes`."""
        cache, steps, done = make_prompt_cache(model), [], 0
        while done < PROMPT:
            chunk = min(sizes[len(steps) % len(sizes)], PROMPT - done)
            tokens = mx.random.randint(0, vocab, (1, chunk))
            mx.eval(tokens)
            started = time.perf_counter()
            if fused:
                mx.eval(fused_forward(model, decode_tokens, decode_cache, tokens, cache), [e.state for e in cache])
                for c in decode_cache:
                    c.trim(1)
            else:
                mx.eval(model.model(tokens, cache=cache), [e.state for e in cache])
            steps.append((chunk, done, round((time.perf_counter() - started) * 1000, 2)))
            done += chunk
        return steps

    decode_ms = statistics.median(decode() for _ in range(30)) * 1000
    result: dict = {"size": args.size, "device": str(mx.default_device()), "decode_ms": decode_ms, "walks": {}}
    print(f"{args.size} on {mx.default_device()}: decode step of {STREAMS} streams {decode_ms:.2f} ms")
    for name, sizes, fused in [("varying, first", VARYING, True), ("varying, again", VARYING, True),
                               ("64", [64], True), ("64, again", [64], True), ("256", [256], True),
                               ("256, again", [256], True), ("512", [512], True),
                               ("alone, one pass", [PROMPT], False), ("alone, one pass again", [PROMPT], False),
                               ("alone, 512", [512], False)]:
        steps = walk(sizes, fused)
        times = [ms for _, _, ms in steps]
        result["walks"][name] = {"steps": steps, "total_ms": sum(times), "median_ms": statistics.median(times),
                                 "max_ms": max(times)}
        print(f"  {name:22s} {len(steps):3d} steps, total {sum(times):7.1f} ms, "
              f"median {statistics.median(times):6.1f}, max {max(times):6.1f}")
    out = Path(args.out) / f"fused_shapes-{args.size}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
