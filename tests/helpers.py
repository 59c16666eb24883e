"""Real processes for the tests: `engined` and `frontend` (gunicorn) started as a user would."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import zmq
import zmq.auth

from protocol import MsgType, decode, encode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The engine inherits the test process's BLAS (LD_PRELOAD or not).

    Tests compare served text with in-process mlx_lm output: both sides must run the
    same BLAS, since two BLAS implementations round differently and greedy decoding
    of a random-weight model can flip on the last bit.
    """
    env = dict(os.environ)
    env.update(extra or {})
    return env


def ping_engine(endpoint: str, timeout: float = 1.0, curve: tuple[Path, Path] | None = None) -> dict | None:
    """PONG body from the engine at `endpoint`, or None when it does not answer.

    `curve`: (server public certificate, client secret certificate) to connect with CURVE.
    """
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        server_key, client_key = curve
        sock.curve_serverkey, _ = zmq.auth.load_certificate(server_key)
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(client_key)
    sock.connect(endpoint)
    try:
        sock.send(encode(MsgType.PING, {"t": time.time()}))
        if sock.poll(int(timeout * 1000)):
            msg_type, body = decode(sock.recv())
            return body if msg_type == MsgType.PONG else None
        return None
    finally:
        sock.close()


def call_engine(endpoint: str, method: str, args: dict | None = None, timeout: float = 30.0) -> object:
    """A CALL straight on the engine socket (as a front-end would), returning RESULT's result."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode(MsgType.CALL, {"cid": "test", "method": method, "args": args or {}}))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer to CALL {method}")
        msg_type, body = decode(sock.recv())
        assert msg_type == MsgType.RESULT, (msg_type, body)
        return body.get("result")
    finally:
        sock.close()


class Proc:
    """A child process with its output in a log file, stopped gracefully then forcibly."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self._log.close()


class Engine(Proc):
    def __init__(self, endpoint: str, log_path: Path, model: str | None = None, args: list[str] | None = None,
                 env: dict[str, str] | None = None):
        argv = [sys.executable, "-m", "engine_daemon", "--endpoint", endpoint, *(args or [])]
        if model:
            argv += ["--model", model]
        super().__init__(argv, log_path, engine_env(env))
        self.endpoint = endpoint

    def wait_ready(self, timeout: float = 60.0, model_loaded: bool = True) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"engined exited with {self.popen.returncode}:\n{self.log()}")
            pong = ping_engine(self.endpoint, 0.5)
            if pong and (pong["state"] == "ready" or not model_loaded):
                return pong
            time.sleep(0.1)
        raise TimeoutError(f"engined not ready after {timeout} s:\n{self.log()}")


class Frontend(Proc):
    def __init__(self, endpoint: str, log_path: Path, port: int | None = None, workers: int = 2,
                 args: list[str] | None = None, pid_file: Path | None = None):
        self.port = port or free_port()
        self.pid_file = pid_file
        argv = [sys.executable, "-m", "http_frontend.cli", "--endpoint", endpoint, "--port", str(self.port),
                "--workers", str(workers), *(args or [])]
        if pid_file:
            argv += ["--pid-file", str(pid_file)]
        super().__init__(argv, log_path, dict(os.environ))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"frontend exited with {self.popen.returncode}:\n{self.log()}")
            try:
                last = httpx.get(f"{self.base_url}/health", timeout=2.0)
                if last.status_code == 200:
                    return last.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"frontend not healthy after {timeout} s (last: {last}):\n{self.log()}")


@contextlib.contextmanager
def running_stack(endpoint: str, logs: Path, *, model: str | None = None, engine_args: list[str] | None = None,
                  env: dict[str, str] | None = None, frontend_args: list[str] | None = None, workers: int = 1,
                  model_loaded: bool | None = None) -> Iterator[tuple[Engine, Frontend]]:
    """A dedicated engined + front-end for tests that need their own flags; both stopped on exit.

    `model_loaded` (default: whether a `model` was given) says whether to wait for a loaded model.
    """
    engine = Engine(endpoint, logs / "engined.log", model=model, args=engine_args, env=env)
    frontend = Frontend(engine.endpoint, logs / "frontend.log", workers=workers, args=frontend_args)
    try:
        engine.wait_ready(model_loaded=bool(model) if model_loaded is None else model_loaded)
        frontend.wait_healthy()
        yield engine, frontend
    finally:
        frontend.stop()
        engine.stop()


def answers_from_two_engines(socket_prefix: str, logs: list[Path], model: str, engine_args: list[str],
                             conversations: list[list[dict]], ask: Callable[[Frontend, str, list[dict]], Any]) -> list:
    """Two engines on the same flags (a shared `--prompt-cache-dir`), each answering one conversation.

    Both are up together and stopped together, so their spills to the shared directory overlap.
    """
    with contextlib.ExitStack() as stacks:
        ends = [stacks.enter_context(running_stack(f"{socket_prefix}-{i}.sock", log, model=model,
                                                   engine_args=engine_args))
                for i, log in enumerate(logs)]
        return [ask(frontend, model, messages) for (_, frontend), messages in zip(ends, conversations)]


@contextlib.contextmanager
def one_frontend_for(engines: dict[str, Engine], log: Path) -> Iterator[Frontend]:
    """One front-end (one worker) routing to every engine of `engines` by its id, the engines ready first;
    the front-end and every engine stopped after."""
    front = None
    try:
        for engine in engines.values():
            engine.wait_ready()
        first, *rest = [f"{engine_id}={engine.endpoint}" for engine_id, engine in engines.items()]
        front = Frontend(first, log, workers=1, args=[arg for endpoint in rest for arg in ("--endpoint", endpoint)])
        front.wait_healthy()
        yield front
    finally:
        if front is not None:
            front.stop()
        for engine in engines.values():
            engine.stop()


@contextlib.contextmanager
def stream_running(url: str, model_id: str, max_tokens: int) -> Iterator[None]:
    """A streaming chat completion decoding in the background (EOS ignored) for the block's duration.

    Entered once its first token arrived, so what the block sends is prefilled beside a running
    stream; left once the stream was dropped or ended.
    """
    streaming, done = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"model": model_id, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url, json=body, timeout=300) as response:
            for line in response.iter_lines():
                if '"content"' in line:
                    streaming.set()
                if done.is_set():
                    break

    runner = threading.Thread(target=stream)
    runner.start()
    try:
        assert streaming.wait(120), "the running stream never produced a token"
        yield
    finally:
        done.set()
        runner.join(300)


def client_for(frontend: Frontend) -> openai.OpenAI:
    """The official openai SDK pointed at a test front-end (no retries: a failure shows at once)."""
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def error_of(response: httpx.Response) -> dict:
    """The OpenAI error object of a response, checked to have exactly OpenAI's four fields."""
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def png(seed: int, width: int = 112, height: int | None = None) -> bytes:
    """A deterministic noise image (112x112: 16 image tokens for the tiny VLM)."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height or width, width, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def float_wav(samples: Any, rate: int = 16_000, dtype: str = "<f4") -> bytes:
    """A mono IEEE-float WAV (format tag 3) of `samples` as float32 or float64 (`dtype`), NaN or infinity kept:
    the stdlib `wave` writes integer PCM only."""
    import struct

    import numpy as np

    data = np.asarray(samples, dtype=dtype).tobytes()
    width = np.dtype(dtype).itemsize
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * width, width, width * 8)
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def pdf(text: str) -> bytes:
    """A real one-page PDF (cross-reference table and all, written by pypdf) showing `text` in Helvetica."""
    from pypdf import PdfWriter
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

    writer = PdfWriter()
    page = writer.add_blank_page(300, 100)
    font = writer._add_object(DictionaryObject({NameObject("/Type"): NameObject("/Font"),
                                                NameObject("/Subtype"): NameObject("/Type1"),
                                                NameObject("/BaseFont"): NameObject("/Helvetica")}))
    fonts = DictionaryObject({NameObject("/F1"): font})
    page[NameObject("/Resources")] = DictionaryObject({NameObject("/Font"): fonts})
    content = DecodedStreamObject()
    content.set_data(f"BT /F1 12 Tf 10 50 Td ({text}) Tj ET".encode())
    page[NameObject("/Contents")] = writer._add_object(content)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
