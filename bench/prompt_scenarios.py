"""Prompt-heavy scenarios on our stack and on mlx_lm.server, one server at a time: a table and a plot.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/prompt_scenarios.py --size small       # ~85M float32 qwen2
    ... python bench/prompt_scenarios.py --size realistic   # the 0.5B-shaped benchmark model

Rows (the issue tracker's prompt scenarios):
  burst        8 requests at once sharing a ~1,500-token system prompt with distinct ~20-token
               questions: seconds until the last first token; replies compared with each sent alone.
  long-prompt  4 clients decode, then a ~1,500-token prompt arrives: the running streams' worst
               inter-token gap while it prefills / their steady median, and the newcomer's TTFT /
               the TTFT of a same-length prompt sent alone (fresh text, so no cache helps either;
               the mean of one sent before the streams and one after). `--long-prompt-trials`
               runs it several times; the table gives the medians and every trial.
  agent-turns  4 conversations at once, 3 turns each, ~1,200-token first turn: mean TTFT of the
               later turns, and that over the first turns' mean.
Writes bench/results/prompt_scenarios-<size>.json and bench/prompt_scenarios-<size>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import one_request  # noqa: E402
from prefix_burst import burst, warm_up  # noqa: E402
from scenarios import NO_PENALTY, streamed_turn, words  # noqa: E402
from stack import bench_model, mlx_lm_server, our_stack  # noqa: E402

OURS, THEIRS = "engined+frontend", "mlx_lm.server"
HERE = Path(__file__).resolve().parent


def no_eos(model: Path) -> dict:
    """A logit bias that keeps random-weight streams from ending early (both servers honour it)."""
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    return {"logit_bias": {str(token): -100 for token in (eos if isinstance(eos, list) else [eos])}}


async def long_prompt_trials(base: str, model: str, extra: dict, args: argparse.Namespace) -> dict:
    """`long_prompt` `--long-prompt-trials` times on one server: each trial, and the medians of their ratios.

    One trial compares two TTFTs taken ~10 s apart, and on a shared 2-core machine the cost of the
    same prefill moved ±20% between them: the median of a few trials says what the server does.
    """
    trials = [await long_prompt(base, model, extra, args.decode_tokens, args.steady_seconds, args.long_words, trial)
              for trial in range(args.long_prompt_trials)]
    middle = sorted(trials, key=lambda trial: trial["ttft_ratio"])[len(trials) // 2]
    return {**middle, "gap_ratio": statistics.median(t["gap_ratio"] for t in trials),
            "ttft_ratio": statistics.median(t["ttft_ratio"] for t in trials), "trials": trials,
            "trials_meeting_both": sum(t["gap_ratio"] <= 3.0 and t["ttft_ratio"] <= 1.5 for t in trials)}


async def long_prompt(base: str, model: str, extra: dict, decode_tokens: int, steady_s: float,
                      long_words: int, trial: int = 0, keep_times: bool = False) -> dict:
    """Gaps of 4 running streams while a long prompt prefills, and that prompt's TTFT vs alone.

    The alone TTFT is the mean of a same-length prompt sent before the streams start and one sent
    after they end (fresh text each, so no cache helps), which halves the drift between them.
    `keep_times` adds the streams' chunk arrival times and the newcomer's send and first-token
    times, on the wall clock (`time.time`) that the engine's log lines use (`long_prompt_gaps.py`).
    """
    url = f"{base}/chat/completions"
    seed = 10 * trial

    def body(prompt: str, max_tokens: int) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}

    async with httpx.AsyncClient(timeout=3600) as http:
        # Four short streams first: a GPU compiles kernels for a batch's shapes the first time it meets them
        # (MLX CUDA on a fresh H100: 2.5-7 s a step), which would eat the steady period below.
        await asyncio.gather(*(one_request(http, url, body(words(100, 400 + seed + i), 8)) for i in range(4)))
        before = await one_request(http, url, body(words(long_words, 97 + seed), 4))
        decoders = [asyncio.create_task(one_request(http, url, body(words(100, 500 + seed + i), decode_tokens)))
                    for i in range(4)]
        await asyncio.sleep(steady_s)
        started = time.perf_counter()
        newcomer = await one_request(http, url, body(words(long_words, 99 + seed), 4))
        first = started + (newcomer.ttft or float("nan"))
        streams = await asyncio.gather(*decoders)
        after = await one_request(http, url, body(words(long_words, 98 + seed), 4))
    steady, during = [], []
    for stream in streams:
        for a, b in zip(stream.chunk_times, stream.chunk_times[1:]):
            if b < started:
                steady.append(b - a)
            elif a < first and b > started:
                during.append(b - a)
    if not steady or not during:
        raise RuntimeError(f"the streams gave {len(steady)} gaps before the newcomer and {len(during)} during its "
                           "prefill: lengthen --steady-seconds or --decode-tokens for this machine")
    median = statistics.median(steady)
    alone_ttft = (before.ttft + after.ttft) / 2
    return {"steady_gap_ms": median * 1000, "worst_gap_ms": max(during) * 1000,
            "gap_ratio": max(during) / median, "gaps_during": len(during),
            "ttft_s": newcomer.ttft, "alone_ttft_s": alone_ttft, "alone_ttfts_s": [before.ttft, after.ttft],
            "ttft_ratio": newcomer.ttft / alone_ttft,
            "streams_ok": all(s.ok for s in streams) and newcomer.ok and before.ok and after.ok,
            **(_wall_times(streams, started, first) if keep_times else {})}


def _wall_times(streams: list, started: float, first: float) -> dict:
    """The trial's `perf_counter` instants on the wall clock, to be joined with the engine's log."""
    offset = time.time() - time.perf_counter()
    return {"newcomer_sent": started + offset, "newcomer_first": first + offset,
            "stream_chunk_times": [[t + offset for t in stream.chunk_times] for stream in streams]}


async def agent_turns(base: str, model: str, extra: dict, conversations: int = 4, turns: int = 3,
                      first_words: int = 800) -> dict:
    """Mean TTFT of first turns and of later turns over concurrent multi-turn conversations."""
    async def conversation(index: int) -> list[tuple[float, int, int]]:
        history = [{"role": "system", "content": words(first_words, 3000 + index)},
                   {"role": "user", "content": words(20, 4000 + index)}]
        out = []
        for turn in range(turns):
            ttft, usage, reply = await streamed_turn(base, model, history, 32, extra)
            cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            out.append((ttft, (usage or {}).get("prompt_tokens", 0), cached))
            history += [{"role": "assistant", "content": reply},
                        {"role": "user", "content": words(20, 5000 + 10 * index + turn)}]
        return out

    results = await asyncio.gather(*(conversation(i) for i in range(conversations)))
    first = [r[0][0] for r in results]
    later = [t[0] for r in results for t in r[1:]]
    cached = [t[2] / t[1] for r in results for t in r[1:] if t[1]]
    return {"first_ttft_s": statistics.mean(first), "later_ttft_s": statistics.mean(later),
            "later_over_first": statistics.mean(later) / statistics.mean(first),
            "later_cached_fraction": statistics.mean(cached) if cached else 0.0,
            "first_prompt_tokens": results[0][0][1]}


def run_server(name: str, start, model: Path, args: argparse.Namespace) -> dict:
    extra = dict(NO_PENALTY) if name == OURS else {}
    with start() as started:
        base = started[0] if isinstance(started, tuple) else started
        asyncio.run(warm_up(base, str(model), extra))
        row: dict = {}
        if "burst" in args.rows:
            row["burst"] = asyncio.run(burst(base, str(model), 8, 0, extra))
            print(f"{name:<17} burst: last first token {row['burst']['last_first_token_s']:.1f} s, "
                  f"{row['burst']['identical']}/8 identical to alone", flush=True)
        if "long-prompt" in args.rows:
            row["long_prompt"] = asyncio.run(long_prompt_trials(base, str(model), {**extra, **no_eos(model)}, args))
            lp = row["long_prompt"]
            for trial in lp["trials"]:
                print(f"{name:<17} long prompt: worst gap {trial['worst_gap_ms']:.0f} ms / steady "
                      f"{trial['steady_gap_ms']:.0f} ms = {trial['gap_ratio']:.2f}x; TTFT {trial['ttft_s']:.2f} s"
                      f" / alone {trial['alone_ttft_s']:.2f} s = {trial['ttft_ratio']:.2f}x", flush=True)
            print(f"{name:<17} long prompt, median of {len(lp['trials'])}: gap {lp['gap_ratio']:.2f}x, TTFT "
                  f"{lp['ttft_ratio']:.2f}x; {lp['trials_meeting_both']} trial(s) met both", flush=True)
        if "agent-turns" in args.rows:
            row["agent_turns"] = asyncio.run(agent_turns(base, str(model), extra))
            at = row["agent_turns"]
            print(f"{name:<17} agent turns: first {at['first_ttft_s']:.2f} s, later {at['later_ttft_s']:.2f} s"
                  f" = {at['later_over_first']:.3f} of first", flush=True)
    return row


def table(results: dict[str, dict]) -> str:
    lines = ["| scenario | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]

    def cell(name: str, row: str, fmt) -> str:
        value = results[name].get(row)
        return fmt(value) if value else "–"

    rows = [
        ("burst: last first token", "burst",
         lambda v: f"{v['last_first_token_s']:.1f} s ({v['identical']}/8 identical)"),
        ("4 streams + long prompt: worst gap / steady (median of trials)", "long_prompt",
         lambda v: f"{v['gap_ratio']:.2f}× ({_each(v, 'gap_ratio')})"),
        ("same: newcomer TTFT / alone (median of trials)", "long_prompt",
         lambda v: f"{v['ttft_ratio']:.2f}× ({_each(v, 'ttft_ratio')}; median {v['ttft_s']:.2f} / "
                   f"{v['alone_ttft_s']:.2f} s)"),
        ("agent turns: later-turn TTFT (/ first)", "agent_turns",
         lambda v: f"{v['later_ttft_s']:.2f} s ({v['later_over_first']:.3f})"),
    ]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(cell(name, key, fmt) for name in results) + " |")
    return "\n".join(lines)


def _each(row: dict, key: str) -> str:
    """Every trial's value, or the one measured when the row predates trials."""
    return ", ".join(f"{trial[key]:.2f}" for trial in row.get("trials", [row]))


def plot(results: dict[str, dict], size: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    panels = [("burst", "last_first_token_s", "shared-prefix burst:\nlast first token (s)"),
              ("long_prompt", "gap_ratio", "long prompt: streams'\nworst gap / steady (×)"),
              ("long_prompt", "ttft_ratio", "long prompt: newcomer\nTTFT / alone (×)"),
              ("agent_turns", "later_ttft_s", "agent turns:\nlater-turn TTFT (s)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4))
    for ax, (row, key, title) in zip(axes, panels):
        values = [results[n].get(row, {}).get(key, 0.0) for n in names]
        bars = ax.bar(names, values, color=["#2b7bba", "#c45a2c"][: len(names)])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        if key == "gap_ratio":  # a stalled server is ~100x: a log scale keeps the others readable
            ax.set_yscale("log")
            ax.axhline(3.0, color="grey", linestyle="--", linewidth=0.8)
        if key == "ttft_ratio":
            ax.axhline(1.5, color="grey", linestyle="--", linewidth=0.8)
    fig.suptitle(f"Prompt scenarios, {size} model, one server at a time (lower is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--rows", nargs="+", default=["burst", "long-prompt", "agent-turns"],
                        choices=["burst", "long-prompt", "agent-turns"])
    parser.add_argument("--decode-tokens", type=int, default=600)
    parser.add_argument("--steady-seconds", type=float, default=6.0)
    parser.add_argument("--long-words", type=int, default=1000, help="~1,500 tokens")
    parser.add_argument("--long-prompt-trials", type=int, default=3,
                        help="long-prompt trials per server; the table gives their medians")
    parser.add_argument("--skip-mlx-lm", action="store_true")
    parser.add_argument("--engine-args", default="", help="extra engined flags, space-separated")
    parser.add_argument("--plot-only", action="store_true", help="redraw the table and plot from the saved JSON")
    args = parser.parse_args()
    out = HERE / "results" / f"prompt_scenarios-{args.size}.json"
    if args.plot_only:
        results = json.loads(out.read_text())
        plot(results, args.size, HERE / f"prompt_scenarios-{args.size}.png")
        print(table(results))
        return 0
    model = bench_model(args.size)
    servers = {OURS: lambda: our_stack(model, ["--decode-concurrency", "8", *args.engine_args.split()])}
    if not args.skip_mlx_lm:
        servers[THEIRS] = lambda: mlx_lm_server(model, ["--decode-concurrency", "8"])
    results = {name: run_server(name, start, model, args) for name, start in servers.items()}
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, args.size, HERE / f"prompt_scenarios-{args.size}.png")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
