"""`mlx-engined-serve`: one command that starts `engined` and `frontend` on one machine.

Picks the model (a small real MLX model from the Hub when cached or downloadable,
else the built-in random-weight model with a loud warning), preloads OpenBLAS for
the engine on Linux, starts the engine, waits until it is ready, then runs the
front-end in the foreground. Ctrl-C stops both.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine_daemon.models.store import ModelNotFound, resolve
from model_builders.text import build_model
from protocol import MsgType, decode, encode
from protocol.endpoints import default_endpoint

log = logging.getLogger("mlx-engined-serve")

DEFAULT_MODEL = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
]
BANNER = "!" * 78


def pick_model(name: str, fallback_dir: Path) -> str:
    """`name` when it is cached or can be downloaded; else a random-weight model, loudly."""
    try:
        return str(resolve(name, allow_download=True).path)
    except ModelNotFound as exc:
        reason = str(exc).splitlines()[0]

    path = build_model(fallback_dir, size="tiny")
    log.warning("\n%s\n!! %s is unavailable (%s).\n!! SERVING A RANDOM-WEIGHT MODEL: its output is NONSENSE.\n"
                "!! It proves the stack works; pass --model to serve a real one.\n%s",
                BANNER, name, reason, BANNER)
    return str(path)


def engine_environment() -> dict[str, str]:
    """Linux CPU: MLX's bundled reference BLAS is ~40x slower than OpenBLAS; preload it when present."""
    env = dict(os.environ)
    if sys.platform == "linux" and "LD_PRELOAD" not in env:
        for candidate in OPENBLAS_CANDIDATES:
            if Path(candidate).exists():
                env["LD_PRELOAD"] = candidate
                break
        else:
            log.warning("OpenBLAS not found: install libopenblas0-pthread for much faster CPU inference")
    return env


def wait_for_engine(endpoint: str, engine: subprocess.Popen, timeout: float) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if engine.poll() is not None:
                raise SystemExit(f"engined exited with status {engine.returncode}")
            sock.send(encode(MsgType.PING, {}))
            if sock.poll(1000):
                msg_type, body = decode(sock.recv())
                if msg_type == MsgType.PONG and body["state"] == "ready":
                    return
            time.sleep(0.2)
        raise SystemExit(f"engined was not ready within {timeout:.0f} s")
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx-engined-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("MLX_ENGINE_MODEL", DEFAULT_MODEL),
                        help="model to serve [MLX_ENGINE_MODEL] (default: %(default)s)")
    parser.add_argument("--endpoint", default=default_endpoint(), help="engine endpoint (default: %(default)s)")
    parser.add_argument("--host", default=os.environ.get("MLX_FRONTEND_HOST", "127.0.0.1"),
                        help="HTTP address [MLX_FRONTEND_HOST] (default: %(default)s)")
    parser.add_argument("--port", default=os.environ.get("MLX_FRONTEND_PORT", "8080"),
                        help="HTTP port [MLX_FRONTEND_PORT] (default: %(default)s)")
    parser.add_argument("--workers", default=os.environ.get("MLX_FRONTEND_WORKERS", "2"),
                        help="front-end workers [MLX_FRONTEND_WORKERS] (default: %(default)s)")
    parser.add_argument("--load-timeout", type=float, default=600.0,
                        help="seconds to wait for the model to load (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    fallback = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx-engined" / "random-tiny-qwen2"
    model = pick_model(args.model, fallback)
    engine = subprocess.Popen([sys.executable, "-m", "engine_daemon", "--model", model, "--endpoint", args.endpoint],
                              env=engine_environment())
    frontend = None
    try:
        wait_for_engine(args.endpoint, engine, args.load_timeout)
        log.info("engine ready; front-end on http://%s:%s/v1", args.host, args.port)
        frontend = subprocess.Popen([sys.executable, "-m", "http_frontend.cli", "--endpoint", args.endpoint,
                                     "--host", args.host, "--port", str(args.port), "--workers", str(args.workers)])
        signal.signal(signal.SIGTERM, lambda *_: frontend.terminate())
        return frontend.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in (frontend, engine):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    sys.exit(main())
