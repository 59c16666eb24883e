"""Clients that vanish mid-stream, cycle after cycle: front-end memory must stay flat.

    python bench/disconnect_soak.py --cycles 500 --concurrency 10

Each cycle starts a streaming request, reads a few events and drops the connection.
Prints the front-end workers' RSS (sum over gunicorn workers) after the warm-up and at
the end, and checks that the engine has nothing left running.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import bench_model, our_stack  # noqa: E402


def workers_rss_mb(base_url: str) -> float:
    port = base_url.rsplit(":", 1)[1].split("/")[0]
    master = subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True).stdout.split()
    total = 0.0
    for pid in master:
        for child in subprocess.run(["pgrep", "-P", pid], capture_output=True, text=True).stdout.split():
            status = Path(f"/proc/{child}/status").read_text()
            total += int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024
    return total


def vanish(base: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=60) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        lines = [line for _, line in zip(range(3), response.iter_lines())]
        if len(lines) < 3:
            raise RuntimeError(f"stream ended early: {lines}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()
    model = bench_model("tiny")
    with our_stack(model, workers=2) as (base, _):
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda _: vanish(base, str(model)), range(args.warmup)))
            time.sleep(1)
            before = workers_rss_mb(base)
            started = time.monotonic()
            list(pool.map(lambda _: vanish(base, str(model)), range(args.cycles)))
            elapsed = time.monotonic() - started
        last = time.monotonic()
        while True:
            stats = httpx.get(base.replace("/v1", "") + "/stats").json()
            if stats["running"] == 0 and stats["queued"] == 0:
                break
            time.sleep(0.01)
        drained = time.monotonic() - last
        time.sleep(1)
        after = workers_rss_mb(base)
    print(f"{args.cycles} disconnect cycles ({args.concurrency} at a time) in {elapsed:.1f} s; engine idle "
          f"{drained * 1000:.0f} ms after the last one; aborted {stats['requests_aborted']}")
    print(f"front-end workers RSS: {before:.1f} MB after {args.warmup} warm-up cycles -> {after:.1f} MB after "
          f"{args.cycles} more ({after - before:+.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
