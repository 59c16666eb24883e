"""Engine groups vs one process: tokens/s at 1 and 8 clients, weight bytes per rank, idle CPU per rank.

Starts, one after the other, a single-process engine, a TP2 group and a PP2 group
(`mlx.launch --backend ring --hosts 127.0.0.1 -n 2`) on the same model, each behind the usual
front-end, and drives each with `loadgen.run_load`. On one machine over loopback a group is
expected to be slower than one process (both ranks share the same cores, and every step pays
the ring's collectives); the point is that it works, and what it costs.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/groups.py --size small --max-tokens 64 --idle-seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.loadgen import format_summary, run_load  # noqa: E402
from bench.stack import bench_model, our_stack  # noqa: E402
from tests.helpers import Frontend, Proc, engine_env  # noqa: E402


def _free_range() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ok = True
        for other in (port + 1, port + 100):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", other))
                except OSError:
                    ok = False
        if ok and port < 60000:
            return port
    raise RuntimeError("no free ports")


@contextmanager
def group_stack(model: Path, mode: str, extra: list[str] | None = None) -> Iterator[tuple[str, Proc]]:
    """(base_url, the mlx.launch process) of a 2-rank group over loopback behind a front-end."""
    work = Path(tempfile.mkdtemp(prefix="mlxe-group-"))
    endpoint = f"ipc://{work}/e.sock"
    argv = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
            "--starting-port", str(_free_range()), "--", sys.executable, "-m", "engine_daemon", "--endpoint",
            endpoint, "--model", str(model), "--group", mode, *(extra or [])]
    launch = Proc(argv, work / "group.log", engine_env())
    frontend = Frontend(endpoint, work / "frontend.log", workers=2)
    try:
        deadline = time.monotonic() + 600
        while True:
            if launch.popen.poll() is not None:
                raise RuntimeError(launch.log())
            try:
                if httpx.get(f"{frontend.base_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(launch.log())
            time.sleep(0.5)
        yield f"{frontend.base_url}/v1", launch
    finally:
        frontend.stop()
        if launch.popen.poll() is None:
            os.killpg(launch.pid, signal.SIGTERM)
            try:
                launch.popen.wait(30)
            except Exception:
                os.killpg(launch.pid, signal.SIGKILL)
        launch.stop()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pids: list[int], seconds: float) -> list[float]:
    """Share of one core each process used over `seconds` of idleness."""
    before = [cpu_seconds(pid) for pid in pids]
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return [round((cpu_seconds(pid) - b) / elapsed * 100, 3) for pid, b in zip(pids, before)]


def measure(name: str, base_url: str, args: argparse.Namespace) -> dict:
    row: dict = {"name": name}
    asyncio.run(run_load(base_url, "default", 1, 1, args.prompt_words, 8))  # warm-up
    for clients in (1, 8):
        summary = asyncio.run(run_load(base_url, "default", clients, clients, args.prompt_words, args.max_tokens,
                                       extra_body={"ignore_eos": True}))
        print(format_summary(f"{name}, {clients} client(s)", summary), flush=True)
        row[f"tps_{clients}"] = round(summary["aggregate_tps"], 2)
        row[f"errors_{clients}"] = summary["errors"]
    health = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10).json()
    group = health.get("group")
    if group:
        row["ranks"] = [{"rank": r["rank"], "weights_MB": round(r["weights_bytes"] / 1e6, 1)} for r in group["ranks"]]
        row["plan_us_mean"] = group.get("plan_us_mean")
        pids = [r["pid"] for r in group["ranks"]]
    else:
        pids = [health["engine"]["pid"]]
    time.sleep(2)
    row["idle_cpu_percent"] = idle_cpu(pids, args.idle_seconds)
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", help="model_builders preset (default: small, 85M float32)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--modes", default="single,tp,pp")
    parser.add_argument("--rank-threads", type=int, default=0,
                        help="per group rank: OPENBLAS_NUM_THREADS and --cpu-parallel-ops (0: the defaults)")
    args = parser.parse_args()
    model = bench_model(args.size)
    full = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"model {model} ({full / 1e6:.1f} MB of safetensors)", flush=True)
    rows = []
    for mode in args.modes.split(","):
        if mode == "single":
            with our_stack(model, ["--prompt-cache-size", "0"]) as (base_url, _):
                rows.append(measure("1 process", base_url, args))
        else:
            extra = ["--cpu-parallel-ops", str(args.rank_threads)] if args.rank_threads else []
            if args.rank_threads:
                os.environ["OPENBLAS_NUM_THREADS"] = str(args.rank_threads)
            with group_stack(model, mode, extra) as (base_url, _):
                rows.append(measure(f"{mode.upper()}2 group", base_url, args))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
