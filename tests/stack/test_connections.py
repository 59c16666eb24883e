"""Half-open and idle connections cannot lock good clients out (isolation issue, attack 10).

Loopback only; every loop is bounded in count and time, and every socket is closed at the end.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Frontend, running_stack

SLOWLORIS, IDLE = 200, 500


@pytest.fixture(scope="module")
def guarded(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    with running_stack(f"ipc://{ipc_dir}/conns.sock", tmp_path_factory.mktemp("conns"), model=str(tiny_model),
                       frontend_args=["--header-timeout", "2", "--worker-connections", "600"],
                       workers=1) as (_, frontend):
        yield frontend


def open_socket(frontend: Frontend) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", frontend.port), timeout=10)
    sock.settimeout(10)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False  # still open 10 s on: the header deadline did not close it
    except OSError:  # reset by the server
        return True


def test_slowloris_and_idle_connections_do_not_stop_a_good_client(guarded: Frontend, model_id: str) -> None:
    slow: list[socket.socket] = []
    idle: list[socket.socket] = []
    try:
        for _ in range(SLOWLORIS):  # a request line and one header, then nothing
            sock = open_socket(guarded)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            slow.append(sock)
        for _ in range(IDLE):  # a complete keep-alive request, answered, then silence
            sock = open_socket(guarded)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            idle.append(sock)
        for sock in idle:
            assert b" 200 " in sock.recv(4096).split(b"\r\n", 1)[0] + b" "
        good = httpx.post(f"{guarded.base_url}/v1/chat/completions", timeout=60, json={
            "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert good.status_code == 200
        # The server closes every half-open connection once its header deadline (2 s) passes.
        assert all(closed_by_server(sock) for sock in slow)
        assert httpx.get(f"{guarded.base_url}/health", timeout=30).status_code == 200
    finally:
        for sock in slow + idle:
            sock.close()
    lines = guarded.log().splitlines()
    assert len(lines) < 2000, f"{len(lines)} log lines"


def test_connections_past_the_cap_get_a_503(tmp_path: Path) -> None:
    """Past --worker-connections a worker answers new connections 503 and closes them (no engine needed)."""
    frontend = Frontend(f"ipc://{tmp_path}/no-engine.sock", tmp_path / "frontend.log", workers=1,
                        args=["--worker-connections", "20"])
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and frontend.popen.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", frontend.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(1.0)  # that probe connection is gone again
        for _ in range(30):
            held.append(open_socket(frontend))
            held[-1].sendall(b"GET /no-such-route HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = [sock.recv(4096) for sock in held]
        assert sum(b"too_many_conns" in answer for answer in answers) >= 5
        assert sum(answer.startswith(b"HTTP/1.1 404") for answer in answers) >= 15
    finally:
        for sock in held:
            sock.close()
        frontend.stop()
