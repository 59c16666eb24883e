"""A long prompt prefilled on a thread of its own beside four decoding streams, instead of fused into their steps.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/concurrent_prefill.py --size small --periods 0,2.5,3 --rounds 3

Why: the long-prompt row (a ~1,500-token prompt arriving while four streams decode) fuses the
prompt's chunks into the streams' decode steps, and every such step carries the cost of a decode
step `D` before its first prompt row (`paced_frontier.py`: ~1.6x the alone TTFT at steps of ~2.7 `D`).
A decode step reads every weight for four rows (memory-bound) while a prompt chunk computes
(compute-bound), so running the two at once on separate threads could hide one behind the other,
and the streams' gaps would follow a clock (`--periods`: a decode step every `P * D`) rather
than the chunk sizes' estimates.

How (in process, no server): OpenBLAS's thread pool serves one caller at a time (a 4-row product
waits up to a whole large product for the pool's worker), so while the prompt runs concurrently
BLAS is set to one thread (`openblas_set_num_threads`) and the prompt's matrix products are split
by rows over two MLX CPU streams of its own thread (`nn.Linear` patched here; MLX streams belong to
the thread that made them). The prompt uses the engine's NumPy prefill paths (`in_process_model`).
Per round: `D` (four streams, two BLAS threads), the prompt alone (512-token chunks, two BLAS
threads), then per period the concurrent prefill's time over the alone one and the streams'
gaps over `D`. Writes bench/results/concurrent_prefill-<size>.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from stack import in_process_model  # noqa: E402

STREAMS, STREAM_PROMPT, STEADY_STEPS, CHUNK, SPLIT_ROWS = 4, 100, 30, 512, 64
_split = threading.local()  # the prompt thread's two MLX streams while it prefills split


def split_linear(linear_call):
    """`nn.Linear.__call__` that, on a thread marked by `_split`, computes the rows in two halves on two streams."""
    import mlx.core as mx

    def call(self, x):
        streams = getattr(_split, "streams", None)
        if streams is None or x.shape[-2] < SPLIT_ROWS:
            return linear_call(self, x)
        half = x.shape[-2] // 2
        with mx.stream(streams[0]):
            first = linear_call(self, x[..., :half, :])
        with mx.stream(streams[1]):
            second = linear_call(self, x[..., half:, :])
        return mx.concatenate([first, second], axis=-2)

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--periods", default="0,2.5,3",
                        help="decode every P*D seconds while the prompt runs (0: back to back)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    from engine_daemon.cpu.prefill_scope import prefilling

    model = in_process_model(args.size)
    nn.Linear.__call__ = split_linear(nn.Linear.__call__)
    blas_threads = ctypes.CDLL(None).openblas_set_num_threads  # the preloaded OpenBLAS
    draw = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [draw.randrange(3, model.args.vocab_size) for _ in range(count)]

    def prefill(prompt: list[int], split: bool) -> None:
        """The prompt's cache in 512-token chunks, then its first token (only the last row's logits)."""
        _split.streams = [mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)] if split else None
        cache = make_prompt_cache(model)
        try:
            with prefilling():
                for start in range(0, len(prompt), CHUNK):
                    hidden = model.model(mx.array([prompt[start:start + CHUNK]]), cache=cache)
                    mx.eval([layer.state for layer in cache])
                mx.eval(mx.argmax(model.model.embed_tokens.as_linear(hidden[:, -1]), axis=-1))
        finally:
            _split.streams = None

    def decode(cache, last):
        logits = model(last, cache=cache)
        last = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(last)
        return last

    periods = [float(value) for value in args.periods.split(",")]
    rounds = []
    for round_number in range(args.rounds):
        blas_threads(2)
        prompt = tokens(args.prompt_tokens)
        started = time.perf_counter()
        prefill(prompt, split=False)
        alone = time.perf_counter() - started
        cache = make_prompt_cache(model)
        last = decode(cache, mx.array([tokens(STREAM_PROMPT) for _ in range(STREAMS)]))
        steady = []
        for _ in range(STEADY_STEPS):
            started = time.perf_counter()
            last = decode(cache, last)
            steady.append(time.perf_counter() - started)
        step = statistics.median(steady)
        row = {"decode_ms": step * 1000, "alone_s": alone, "periods": {}}
        for period in periods:
            blas_threads(1)
            finished, seconds = threading.Event(), []

            def prompt_thread() -> None:
                begun = time.perf_counter()
                prefill(tokens(args.prompt_tokens), split=True)
                seconds.append(time.perf_counter() - begun)
                finished.set()

            marks = [time.perf_counter()]
            worker = threading.Thread(target=prompt_thread)
            worker.start()
            while not finished.is_set():
                if period:
                    time.sleep(max(0.0, marks[0] + (len(marks) - 1) * period * step - time.perf_counter()))
                last = decode(cache, last)
                marks.append(time.perf_counter())
            worker.join()
            blas_threads(2)
            gaps = [later - earlier for earlier, later in zip(marks, marks[1:])]
            row["periods"][str(period)] = {"ttft_ratio": seconds[0] / alone,
                                           "gap_median_over_d": statistics.median(gaps) / step,
                                           "gap_max_over_d": max(gaps) / step, "gaps": len(gaps)}
        rounds.append(row)
        print(f"round {round_number}: D {row['decode_ms']:.1f} ms, alone {alone:.2f} s | " + " | ".join(
            f"P {period}: TTFT {cell['ttft_ratio']:.2f}x, gaps median {cell['gap_median_over_d']:.2f} D, "
            f"max {cell['gap_max_over_d']:.2f} D" for period, cell in row["periods"].items()), flush=True)
    out = HERE / "results" / f"concurrent_prefill-{args.size}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"size": args.size, "prompt_tokens": args.prompt_tokens, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
