"""Where a decode step's time goes: py-spy samples of our engine and of mlx_lm.server under 8 clients.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/profile_decode.py --size small --seconds 20

Each server runs alone with the same load as compare.py (8 streaming clients, ~100-token
prompts); py-spy samples the serving process (`--idle` on: time waiting in `mx.eval` is
the model computing; `--native` off: MLX's C++ time shows as the Python frame that called it).
Only the generation thread's samples count (our mlx thread; mlx_lm.server's generation
thread), grouped by what the innermost known frame does: the model's
forward pass and its evaluation, sampling, detokenization and output parsing, the transport,
and the rest. Writes bench/results/profile_decode-<size>.json (and the raw stacks next to it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import run_load  # noqa: E402
from stack import bench_model, mlx_lm_server, our_stack  # noqa: E402

HERE = Path(__file__).resolve().parent
# First match wins, checked from the innermost frame outwards.
CATEGORIES = [
    ("model forward (graph build)", ("mlx_lm/models/", "fused_step.py")),
    ("evaluation (mx.eval / async_eval wait)", ("_step (mlx_lm/generate.py", "mx.eval", "eval (")),
    ("sampling / logits processors", ("sample_utils", "samplers.py", "logits_processors", "sampling/")),
    ("detokenize / output parsing", ("detokeniz", "output/", "tokenizer_utils", "tool_parsers", "reasoning")),
    ("transport / HTTP", ("zmq", "transport/", "http/server", "socketserver", "json/encoder", "msgpack")),
    ("scheduler / batching bookkeeping", ("scheduling/", "generate.py", "grouped.py", "stall_free.py")),
]


def categorize(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        for name, needles in CATEGORIES:
            if any(needle in frame for needle in needles):
                return name
    return "other (idle waits, GC, threads)"


def profile(pid: int, seconds: int, out: Path) -> Counter:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200",
                    "--format", "raw", "--output", str(out), "--nonblocking", "--idle"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counts: Counter = Counter()
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "generate.py" in stack or "MlxWorker" in stack or "_generate" in stack:  # the generation thread only
            counts[categorize(stack)] += int(n)
    return counts


def load(base: str, model: str, extra: dict, stop: threading.Event) -> None:
    seed = 0
    while not stop.is_set():
        asyncio.run(run_load(base, model, 8, 16, 100, 64, 0.0, extra_body=extra, seed=seed))
        seed += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "realistic"])
    parser.add_argument("--seconds", type=int, default=20)
    args = parser.parse_args()
    model = bench_model(args.size)
    results = {}
    for name in ("engined+frontend", "mlx_lm.server"):
        if name == "engined+frontend":
            server = our_stack(model, ["--decode-concurrency", "8"])
        else:
            server = mlx_lm_server(model, ["--decode-concurrency", "8"])
        with server as started:
            base, pid = (started[0], started[1].popen.pid) if isinstance(started, tuple) else (started, None)
            if pid is None:
                pid = int(subprocess.check_output(["pgrep", "-f", f"mlx_lm.server --model {model}"]).split()[0])
            extra = {"repetition_penalty": 1.0} if name == "engined+frontend" else {}
            stop = threading.Event()
            driver = threading.Thread(target=load, args=(base, str(model), extra, stop), daemon=True)
            driver.start()
            asyncio.run(asyncio.sleep(5))  # into steady decoding
            raw = HERE / "results" / f"profile_decode-{args.size}-{name.split('.')[0].split('+')[0]}.txt"
            raw.parent.mkdir(exist_ok=True)
            counts = profile(pid, args.seconds, raw)
            stop.set()
            driver.join(600)
        total = sum(counts.values()) or 1
        results[name] = {k: round(100 * v / total, 1) for k, v in counts.most_common()}
        print(f"{name}: " + ", ".join(f"{k} {v}%" for k, v in results[name].items()), flush=True)
    (HERE / "results" / f"profile_decode-{args.size}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
