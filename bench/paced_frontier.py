"""What any pacing of a long prompt beside streams can reach on this machine: the real generator at fixed chunks.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/paced_frontier.py --size small --chunks 44,60,76,92 --rounds 5

The long-prompt row asks for two things at once: the running streams' worst gap at most 3x
their steady one, and the newcomer's TTFT at most 1.5x its alone TTFT. Both depend on how a
step's time is shared, and the engine's pacer (`PrefillPacer`, `LayerDeadline`) is one policy
for that; this script takes the policy out. In process, no server, no pacer, no cuts: mlx-lm's
`BatchGenerator` as the engine runs it (`StallFreeBatchGenerator`, the CPU's NumPy prefill
paths), four streams decoding, then a ~1,500-token prompt prefilled in fixed chunks of `c`
tokens, each fused into a decode step. Per chunk size: the steps' median and largest time over
the streams' decode step `D` (what their gaps would be), and the newcomer's time to its first
token over the same prompt's prefilled alone (512-token chunks, no streams) in the same round.

Every policy that fuses chunks into decode steps lies on or above this curve: a pacer can only
choose the chunk (steps of `r*D` where the curve gives its TTFT ratio) and add its own overhead.
Rounds interleave the chunk sizes so that the machine's drift (a 2-vCPU VM's compute speed moves
by ~25% over tens of seconds) spreads over all of them. Writes bench/results/paced_frontier-<size>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from stack import in_process_model  # noqa: E402

STREAMS, STREAM_PROMPT, WARM_STEPS, ALONE_CHUNK = 4, 100, 40, 512


def tokens(seed: int, count: int, vocab: int) -> list[int]:
    """Random token ids below `vocab` (fresh ones each prompt: no cache could help)."""
    draw = random.Random(seed)
    return [draw.randrange(3, vocab) for _ in range(count)]


def until_first_token(generator, uid: int) -> list[float]:
    """Steps `generator` until `uid` gets its first token: each step's seconds."""
    steps = []
    while True:
        started = time.perf_counter()
        _prompts, responses = generator.next()
        steps.append(time.perf_counter() - started)
        if any(response.uid == uid for response in responses):
            return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--chunks", default="44,60,76,92", help="fixed chunk sizes c")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from engine_daemon.generation.stall_free import StallFreeBatchGenerator

    model = in_process_model(args.size)
    chunks = [int(value) for value in args.chunks.split(",")]
    vocab = model.args.vocab_size

    samples: dict[int, list[dict]] = {chunk: [] for chunk in chunks}
    for round_number in range(args.rounds):
        alone = StallFreeBatchGenerator(model, prefill_step_size=ALONE_CHUNK, completion_batch_size=8)
        (uid,) = alone.insert([tokens(1000 + round_number, args.prompt_tokens, vocab)], max_tokens=[2])
        alone_seconds = sum(until_first_token(alone, uid))
        for chunk in chunks:
            generator = StallFreeBatchGenerator(model, prefill_step_size=chunk, completion_batch_size=8)
            generator.insert([tokens(100 * round_number + i, STREAM_PROMPT, vocab) for i in range(STREAMS)],
                             max_tokens=[10_000] * STREAMS)
            decode = []
            for _ in range(WARM_STEPS):
                started = time.perf_counter()
                generator.next()
                decode.append(time.perf_counter() - started)
            decode_seconds = statistics.median(decode[WARM_STEPS // 4:])
            (uid,) = generator.insert([tokens(2000 + round_number, args.prompt_tokens, vocab)], max_tokens=[2])
            steps = until_first_token(generator, uid)
            paced = steps[1:-1]  # the first holds the newcomer's admission, the last its join
            sample = {"ttft_ratio": sum(steps) / alone_seconds, "decode_ms": decode_seconds * 1000,
                      "median_step_over_d": statistics.median(paced) / decode_seconds,
                      "max_step_over_d": max(paced) / decode_seconds, "steps": len(steps),
                      "alone_s": alone_seconds, "paced_s": sum(steps)}
            samples[chunk].append(sample)
            print(f"round {round_number} c={chunk}: TTFT {sample['ttft_ratio']:.2f}x alone ({sample['paced_s']:.2f} / "
                  f"{alone_seconds:.2f} s), steps median {sample['median_step_over_d']:.2f} D, max "
                  f"{sample['max_step_over_d']:.2f} D (D {sample['decode_ms']:.1f} ms)", flush=True)
    summary = {}
    print(f"{'c':>4} {'step/D med':>10} {'max':>6} {'TTFT/alone med':>15} {'range':>12}")
    for chunk, rows in samples.items():
        ratios = [row["ttft_ratio"] for row in rows]
        summary[str(chunk)] = {"median_step_over_d": statistics.median(r["median_step_over_d"] for r in rows),
                               "max_step_over_d": max(r["max_step_over_d"] for r in rows),
                               "ttft_ratio_median": statistics.median(ratios), "ttft_ratios": ratios}
        row = summary[str(chunk)]
        print(f"{chunk:4d} {row['median_step_over_d']:10.2f} {row['max_step_over_d']:6.2f} "
              f"{row['ttft_ratio_median']:15.2f} {min(ratios):5.2f}-{max(ratios):.2f}")
    out = HERE / "results" / f"paced_frontier-{args.size}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"size": args.size, "prompt_tokens": args.prompt_tokens, "chunks": summary,
                               "rounds": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
