"""An engine group's prompt cache: the next turn of a long conversation, with the cache on and off.

For TP2 and PP2 groups (`bench/groups.py`'s `group_stack`, loopback ring) with the default
prompt cache and with `--prompt-cache-size 0`: turn 1 sends a long prompt; turn 2 resends it
with the assistant's reply and a new question. Reports turn 2's cached tokens (usage) and its
time to first token (client clock: a benchmark figure, not a test assertion).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/group_prompt_cache.py --size small --words 600
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.groups import group_stack  # noqa: E402
from bench.stack import bench_model  # noqa: E402


def turn(base_url: str, messages: list[dict]) -> tuple[str, float, dict]:
    """(text, seconds to the first content chunk, usage) of one streamed greedy reply."""
    body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if choice["delta"].get("content") and first is None:
                    first = time.perf_counter() - started
                text += choice["delta"].get("content") or ""
    return text, first or 0.0, usage


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--words", type=int, default=600)
    parser.add_argument("--modes", default="tp,pp")
    args = parser.parse_args()
    model = bench_model(args.size)
    context = " ".join(f"word{i % 97}" for i in range(args.words))
    rows = []
    for mode in args.modes.split(","):
        for label, extra in (("cache on", []), ("cache off", ["--prompt-cache-size", "0"])):
            with group_stack(model, mode, extra) as (base_url, _):
                first = [{"role": "user", "content": f"Read this: {context}. What is the first word?"}]
                reply, ttft1, usage1 = turn(base_url, first)
                second = first + [{"role": "assistant", "content": reply},
                                  {"role": "user", "content": "And the last word?"}]
                _, ttft2, usage2 = turn(base_url, second)
            row = {"mode": mode.upper() + "2", "cache": label, "turn1_prompt": usage1.get("prompt_tokens"),
                   "turn1_ttft_s": round(ttft1, 3), "turn2_prompt": usage2.get("prompt_tokens"),
                   "turn2_cached": (usage2.get("prompt_tokens_details") or {}).get("cached_tokens"),
                   "turn2_ttft_s": round(ttft2, 3)}
            print(row, flush=True)
            rows.append(row)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
