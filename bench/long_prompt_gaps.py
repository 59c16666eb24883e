"""Where the long-prompt row's worst gaps come from: client arrival times joined with the engine's steps.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/long_prompt_gaps.py --size small --trials 4

Runs `prompt_scenarios.long_prompt` on our stack with the engine at DEBUG (its log then has
one line per generator step: its time, streams and prompt tokens) and joins each stream's
chunk arrivals (client wall clock) with the step that produced them (the latest step that
ended before the chunk arrived). Per trial: the row's two ratios, the steps the newcomer was
paced in and their cost per prompt token against its alone TTFT's (`paced`), how long after its step a
token reaches the client (the delivery delay), and the worst client gaps with the engine
period between the two steps under them. A worst gap equal to its engine period is the
engine's step; one much longer than it is delivery. The four streams get one token per step
each, so they see the same gaps. Writes bench/results/long_prompt_gaps-<size>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import json
import os
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from prefix_burst import warm_up  # noqa: E402
from prompt_scenarios import long_prompt, no_eos  # noqa: E402
from scenarios import NO_PENALTY  # noqa: E402
from stack import bench_model, our_stack  # noqa: E402

STEP_LINE = re.compile(r"step ([\d.]+) ms: (\d+) decoding, (\d+) prompt tokens")


def engine_steps(log: str) -> list[tuple[float, float, int, int]]:
    """(wall-clock end, generator ms, streams, prompt tokens) of each step in an engine DEBUG log."""
    steps = []
    for line in log.splitlines():
        found = STEP_LINE.search(line)
        if found:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            ended = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
            steps.append((ended, float(found.group(1)), int(found.group(2)), int(found.group(3))))
    return steps


def joined(trial: dict, steps: list[tuple[float, float, int, int]], worst: int = 3) -> dict:
    """The trial's delivery delays and worst gaps, each with the engine period under it."""
    ends = [step[0] for step in steps]

    def step_before(instant: float) -> int:
        return bisect.bisect_right(ends, instant) - 1

    sent, first = trial["newcomer_sent"], trial["newcomer_first"]
    delays, gaps = [], []
    for times in trial["stream_chunk_times"]:
        for earlier, later in zip(times, times[1:]):
            if earlier < first and later > sent:
                a, b = step_before(earlier), step_before(later)
                gaps.append({"gap_ms": (later - earlier) * 1000, "engine_period_ms": (ends[b] - ends[a]) * 1000,
                             "ended_after_newcomer_ms": (later - sent) * 1000, "arrived_at": later,
                             "newcomer_ttft_ms": (first - sent) * 1000,
                             "delays_ms": [(earlier - ends[a]) * 1000, (later - ends[b]) * 1000],
                             "step_prompt_tokens": steps[b][3]})
        delays += [(t - ends[step_before(t)]) * 1000 for t in times if sent < t < first]
    gaps.sort(key=lambda gap: -gap["gap_ms"])
    delays.sort()
    return {"delivery_ms": {"p50": statistics.median(delays), "p90": delays[int(0.9 * (len(delays) - 1))],
                            "max": delays[-1]},
            "worst_gaps": gaps[:worst]}


def paced(trial: dict, steps: list[tuple[float, float, int, int]]) -> dict:
    """What the engine's steps did while the newcomer was paced beside the streams, in its own clock.

    A trial's TTFT ratio moves with two things: how the scheduler shares each step (its steps,
    tokens per step) and how fast this machine computes a prompt token at that moment (a 2-vCPU VM
    has phases: a 1024x1024 sgemm took 10.5 ms for tens of seconds, then 13). The steps' time past
    the streams' steady decode step, per prompt token, against the alone TTFT per prompt token,
    tells them apart: the first is the machine, the count of steps is the scheduler.
    """
    sent, first = trial["newcomer_sent"], trial["newcomer_first"]
    decode = [ms for end, ms, streams, tokens in steps if end < sent and streams == 4 and tokens == 0]
    during = [(ms, tokens) for end, ms, streams, tokens in steps if sent < end <= first and streams == 4]
    decode_ms = statistics.median(decode[-40:]) if decode else float("nan")
    tokens = sum(t for _ms, t in during)
    spent = sum(ms for ms, _t in during)
    return {"paced_steps": len(during), "paced_tokens": tokens, "paced_ms": spent, "decode_ms": decode_ms,
            "prompt_ms_per_token": (spent - len(during) * decode_ms) / max(1, tokens),
            "alone_ms_per_token": trial["alone_ttft_s"] * 1000 / max(1, tokens)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=600)
    parser.add_argument("--steady-seconds", type=float, default=6.0)
    parser.add_argument("--long-words", type=int, default=1000, help="~1,500 tokens")
    parser.add_argument("--engine-args", default="", help="extra engined flags, space-separated")
    args = parser.parse_args()
    os.environ["MLX_ENGINE_LOG_LEVEL"] = "DEBUG"
    model = bench_model(args.size)
    extra = {**NO_PENALTY, **no_eos(model)}
    with our_stack(model, ["--decode-concurrency", "8", *args.engine_args.split()]) as (base, engine):
        asyncio.run(warm_up(base, str(model), dict(NO_PENALTY)))
        trials = [asyncio.run(long_prompt(base, str(model), extra, args.decode_tokens, args.steady_seconds,
                                          args.long_words, trial, keep_times=True))
                  for trial in range(args.trials)]
        steps = engine_steps(engine.log())
    report = []
    for number, trial in enumerate(trials):
        found = joined(trial, steps) | paced(trial, steps)
        report.append({key: trial[key] for key in ("gap_ratio", "ttft_ratio", "steady_gap_ms", "worst_gap_ms",
                                                   "ttft_s", "alone_ttft_s")} | found)
        delivery = found["delivery_ms"]
        print(f"trial {number}: worst gap {trial['gap_ratio']:.2f}x steady ({trial['worst_gap_ms']:.0f} / "
              f"{trial['steady_gap_ms']:.1f} ms), TTFT {trial['ttft_ratio']:.2f}x alone; token delivery after its "
              f"step p50 {delivery['p50']:.1f}, p90 {delivery['p90']:.1f}, max {delivery['max']:.1f} ms")
        print(f"   paced: {found['paced_steps']} steps, {found['paced_tokens']} prompt tokens in "
              f"{found['paced_ms']:.0f} ms; past the {found['decode_ms']:.1f} ms decode step "
              f"{found['prompt_ms_per_token']:.2f} ms a prompt token, alone {found['alone_ms_per_token']:.2f}")
        for gap in found["worst_gaps"]:
            print(f"   gap {gap['gap_ms']:.0f} ms over an engine period of {gap['engine_period_ms']:.0f} ms, ending "
                  f"{gap['ended_after_newcomer_ms']:.0f} of the newcomer's {gap['newcomer_ttft_ms']:.0f} ms "
                  f"({gap['step_prompt_tokens']} prompt tokens; delivered {gap['delays_ms'][0]:.1f} then "
                  f"{gap['delays_ms'][1]:.1f} ms after their steps)")
    met = sum(t["gap_ratio"] <= 3.0 and t["ttft_ratio"] <= 1.5 for t in trials)
    print(f"{met} of {len(trials)} trials met both (worst gap <= 3x, TTFT <= 1.5x)")
    out = HERE / "results" / f"long_prompt_gaps-{args.size}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"trials": report, "met_both": met}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
