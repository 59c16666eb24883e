"""What a prompt chunk costs beside running streams, and what that allows the long-prompt targets.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/fused_costs.py --size small

In process, on the engine's own code paths (`fused_forward`, the CPU's NumPy prefill paths),
interleaved so that the machine's drift cancels: a decode step of 4 streams (`D`), a prompt
chunk of `c` tokens at context `L` computed alone (`A`) and the same chunk fused into the
decode step (`F`), and the same prompt's cost per token in large chunks (`--large`, how a
prompt sent alone is prefilled). Then:

- the decode rows' share of a fused step, `F - A` (what fusing leaves the streams to pay);
- `F` as `base + b*c` per context (fitted over the tile-aligned chunks): the chunk's
  marginal cost per token `b` beside the alone cost per token;
- the long-prompt row's bound: with fused steps of at most `r*D` (the streams' worst gap is
  then `r` times their steady gap), a step at context `L` carries `(r*D - base)/b` tokens, so
  the newcomer's time per prompt token is `r*D/tokens` against the alone cost per token:
  its TTFT ratio at that context. "any" lets a chunk take any size; "tiled" only sizes whose
  pass fills whole 16-row tiles with the streams' rows (`ROW_TILE`: a partial tile costs
  what the whole one does, so the pacer takes those), the largest whose fitted cost fits.
  `--ratios` lists the `r` to evaluate; no room is left for step-to-step noise;
- the spread of one fused step repeated (`--repeats`): what the same work costs from one
  step to the next on this machine, which a gap target has to leave room for.

Writes bench/results/fused_costs-<size>.json.
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
from stack import in_process_model  # noqa: E402

from engine_daemon.scheduling.cost_floor import least_squares_line  # noqa: E402

STREAMS, STREAM_CONTEXT, ROW_TILE = 4, 600, 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic", "wide-kv"])
    parser.add_argument("--contexts", default="0,700,1400", help="prompt context positions L")
    parser.add_argument("--chunks", default="28,44,60,76",
                        help="chunk sizes c (rows with 4 streams: whole 16-row tiles)")
    parser.add_argument("--large", type=int, default=508, help="the large chunk that stands for a prompt sent alone")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=100, help="repeats of one fused step for its spread")
    parser.add_argument("--ratios", default="2.5,3.0")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine_daemon.cpu.prefill_scope import prefilling
    from engine_daemon.generation.fused_step import fused_forward

    model = in_process_model(args.size)
    vocab = model.args.vocab_size  # token ids past it are read out of the embedding's bounds (a crash)

    def filled(batch: int, length: int) -> list:
        cache = make_prompt_cache(model)
        tokens = mx.random.randint(0, vocab, (batch, length))
        with prefilling():
            for start in range(0, length, 256):
                model(tokens[:, start:start + 256], cache=cache)
                mx.eval([c.state for c in cache])
        return cache

    def trimmed(cache: list, n: int) -> None:
        for c in cache:
            c.trim(n)

    def timed(work) -> float:
        started = time.perf_counter()
        work()
        return time.perf_counter() - started

    contexts = [int(v) for v in args.contexts.split(",")]
    chunks = [int(v) for v in args.chunks.split(",")]
    decode_cache = filled(STREAMS, STREAM_CONTEXT)
    decode_tokens = mx.random.randint(0, vocab, (STREAMS, 1))
    prompt_caches = {length: filled(1, length) for length in contexts}
    inputs = {c: mx.random.randint(0, vocab, (1, c)) for c in [*chunks, args.large]}
    mx.eval(decode_tokens, list(inputs.values()))

    def decode() -> None:
        mx.eval(model(decode_tokens, cache=decode_cache))
        trimmed(decode_cache, 1)

    def alone(c: int, length: int) -> None:
        with prefilling():
            mx.eval(model.model(inputs[c], cache=prompt_caches[length]), [e.state for e in prompt_caches[length]])
        trimmed(prompt_caches[length], c)

    def fused(c: int, length: int) -> None:
        mx.eval(fused_forward(model, decode_tokens, decode_cache, inputs[c], prompt_caches[length]),
                [e.state for e in prompt_caches[length]])
        trimmed(prompt_caches[length], c)
        trimmed(decode_cache, 1)

    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for length in contexts:
            samples.setdefault("large", []).append(timed(lambda: alone(args.large, length)) / args.large)
            samples.setdefault(f"large@{length}", []).append(samples["large"][-1])
            for c in chunks:
                samples.setdefault("D", []).append(timed(decode))
                samples.setdefault(f"A{c}@{length}", []).append(timed(lambda: alone(c, length)))
                samples.setdefault(f"F{c}@{length}", []).append(timed(lambda: fused(c, length)))
    ms = {key: statistics.median(values) * 1000 for key, values in samples.items()}
    d = ms["D"]
    result: dict = {"size": args.size, "decode_ms": d, "contexts": {}}
    print(f"decode step, {STREAMS} streams: D = {d:.1f} ms")
    print(f"{'L':>5} {'c':>4} {'A ms':>7} {'F ms':>7} {'F-A ms':>7} {'F/D':>5}")
    for length in contexts:
        rows = []
        for c in chunks:
            a, f = ms[f"A{c}@{length}"], ms[f"F{c}@{length}"]
            rows.append({"chunk": c, "alone_ms": a, "fused_ms": f})
            print(f"{length:5d} {c:4d} {a:7.1f} {f:7.1f} {f - a:7.1f} {f / d:5.2f}")
        base, per_token = least_squares_line([r["chunk"] for r in rows], [r["fused_ms"] for r in rows])
        alone_per_token = ms[f"large@{length}"]
        bound = {}
        for ratio in (float(v) for v in args.ratios.split(",")):
            tokens = (ratio * d - base) / per_token
            tiled = max((c for c in range(ROW_TILE - STREAMS, 4096, ROW_TILE) if base + per_token * c <= ratio * d),
                        default=None)
            bound[str(ratio)] = {
                "any": ratio * d / tokens / alone_per_token if tokens > 0 else float("inf"),
                "tiled": (base + per_token * tiled) / tiled / alone_per_token if tiled else float("inf"),
                "tiled_chunk": tiled}
        result["contexts"][str(length)] = {"chunks": rows, "fused_base_ms": base, "fused_ms_per_token": per_token,
                                            "alone_ms_per_token": alone_per_token, "ttft_ratio_at": bound}
        print(f"      fused = {base:.1f} ms + {per_token:.2f} ms/token (base = {base / d:.2f} D); alone "
              f"{alone_per_token:.2f} ms/token; newcomer's TTFT / alone at steps of r*D: "
              + ", ".join(f"r={r}: {v['any']:.2f}x (tiled: {v['tiled']:.2f}x, {v['tiled_chunk']} tokens)"
                          for r, v in bound.items()))
    spread = _spread(lambda: fused(chunks[len(chunks) // 2], contexts[len(contexts) // 2]), decode, args.repeats)
    result["spread"] = spread
    print(f"one fused step ({chunks[len(chunks) // 2]} tokens at {contexts[len(contexts) // 2]}) repeated "
          f"{args.repeats}x: p50 {spread['p50_ms']:.1f}, p90 {spread['p90_ms']:.1f}, max {spread['max_ms']:.1f} ms "
          f"(max / p50 {spread['max_ms'] / spread['p50_ms']:.2f}); decode steps p50 {spread['decode_p50_ms']:.1f}, "
          f"max {spread['decode_max_ms']:.1f} ms")
    out = HERE / "results" / f"fused_costs-{args.size}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


def _spread(fused_step, decode_step, repeats: int) -> dict:
    """Percentiles of one fused step repeated, alternating with decode steps as in a prefill beside streams."""
    fused_times, decode_times = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        fused_step()
        fused_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        decode_step()
        decode_times.append(time.perf_counter() - started)
    fused_times.sort()
    decode_times.sort()
    return {"p50_ms": statistics.median(fused_times) * 1000, "p90_ms": fused_times[int(0.9 * (repeats - 1))] * 1000,
            "max_ms": fused_times[-1] * 1000, "decode_p50_ms": statistics.median(decode_times) * 1000,
            "decode_max_ms": decode_times[-1] * 1000}


if __name__ == "__main__":
    sys.exit(main())
