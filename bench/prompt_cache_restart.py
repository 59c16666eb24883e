"""The next turn of a long conversation after an engine restart, with `--prompt-cache-dir`.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/prompt_cache_restart.py --size realistic --history-words 2700

Turn 1 (~4,000 tokens) is answered cold; the engine stops (SIGTERM: the hot prefixes go to disk)
and starts again on the same directory; turn 2 is timed. Then the same turn 2 on an engine with
an empty cache directory gives the cold reference. Reported: cached tokens and TTFT of each.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenarios import streamed_turn, words  # noqa: E402
from stack import bench_model, our_stack  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=["tiny", "small", "realistic"])
    parser.add_argument("--history-words", type=int, default=2700, help="~4,000 tokens of conversation")
    args = parser.parse_args()
    model = bench_model(args.size)
    cache = Path(tempfile.mkdtemp(prefix="mlxe-kv-"))
    first = [{"role": "system", "content": "You are a careful assistant."},
             {"role": "user", "content": words(args.history_words, 7)}]
    engine_args = ["--prompt-cache-dir", str(cache)]
    with our_stack(model, engine_args) as (base, _):
        ttft1, usage1, reply = asyncio.run(streamed_turn(base, str(model), first, 16))
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Summarize that."}]
    with our_stack(model, engine_args) as (base, _):
        ttft2, usage2, text2 = asyncio.run(streamed_turn(base, str(model), second, 16))
    with our_stack(model, ["--prompt-cache-dir", tempfile.mkdtemp(prefix="mlxe-kv-cold-")]) as (base, _):
        ttft_cold, usage_cold, text_cold = asyncio.run(streamed_turn(base, str(model), second, 16))
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    print(f"turn 1: {usage1['prompt_tokens']} prompt tokens, TTFT {ttft1:.2f} s (cold)")
    print(f"turn 2 after a restart: {usage2['prompt_tokens']} prompt tokens, {cached} cached "
          f"({cached / usage2['prompt_tokens']:.1%}), TTFT {ttft2:.2f} s")
    print(f"turn 2 cold: cached {usage_cold['prompt_tokens_details']['cached_tokens']}, TTFT {ttft_cold:.2f} s; "
          f"restored / cold = {ttft2 / ttft_cold:.1%}; same text: {text2 == text_cold}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
