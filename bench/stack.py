"""Starting the servers under test: our engined + frontend, and mlx_lm.server, on one model."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers import Engine, Frontend, free_port  # noqa: E402

DEFAULT_MODELS = Path.home() / ".cache" / "mlx-engined" / "bench-models"


def bench_model(size: str = "realistic") -> Path:
    from model_builders.text import build_model

    return build_model(DEFAULT_MODELS / f"{size}-qwen2", size=size)


def in_process_model(size: str):
    """The bench model loaded in this process with the CPU paths `engined` takes by default.

    Two parallel ops, NumPy prefill attention and SwiGLU, `parallel_ops` installed: what the
    engine's generator runs on, for in-process measurements (`fused_costs.py`, `paced_frontier.py`).
    """
    from mlx_lm import load

    from engine_daemon.cpu import parallel_ops, prefill_attention, prefill_swiglu

    parallel_ops.configure(2)
    prefill_attention.configure(True)
    prefill_swiglu.configure(True)
    model, _tokenizer = load(str(bench_model(size)))
    parallel_ops.install()
    return model


@contextmanager
def our_stack(model: Path, engine_args: list[str] | None = None, workers: int = 2) -> Iterator[tuple[str, Engine]]:
    """(base_url, engine) of a running engined + gunicorn front-end."""
    work = Path(tempfile.mkdtemp(prefix="mlxe-bench-"))
    engine = Engine(f"ipc://{work}/e.sock", work / "engined.log", model=str(model), args=engine_args)
    frontend = Frontend(engine.endpoint, work / "frontend.log", workers=workers)
    try:
        engine.wait_ready(timeout=600)
        frontend.wait_healthy()
        yield f"{frontend.base_url}/v1", engine
    finally:
        frontend.stop()
        engine.stop()


@contextmanager
def mlx_lm_server(model: Path, args: list[str] | None = None, launcher: list[str] | None = None) -> Iterator[str]:
    """mlx_lm.server on `model`; `launcher` replaces `-m mlx_lm.server` (`mlx_lm_steps.py` traces its steps)."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="mlxlm-bench-"))
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, *(launcher or ["-m", "mlx_lm.server"]), "--model", str(model),
                             "--port", str(port), *(args or [])], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError((work / "server.log").read_text())
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def peak_rss_mb(pid: int) -> float | None:
    """Peak resident memory of a process (Linux /proc; None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
