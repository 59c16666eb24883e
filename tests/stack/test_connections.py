"""Half-open and idle connections cannot lock good clients out (isolation issue, attack 10).

Loopback only; every loop is bounded in count and time, and every socket is closed at the end.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from http_frontend.middleware.connections import BODY_STALL_SECONDS
from tests.helpers import Frontend, Proc, free_port, running_stack

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


def test_a_body_that_stops_arriving_is_closed(guarded: Frontend, model_id: str) -> None:
    """Headers, then part of the body, then silence: closed once no body byte came for --header-timeout (2 s)."""
    stalled = [open_socket(guarded) for _ in range(20)]
    try:
        for sock in stalled:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000\r\n\r\n{\"model\"")
        assert all(closed_by_server(sock) for sock in stalled)
        good = httpx.post(f"{guarded.base_url}/v1/chat/completions", timeout=60, json={
            "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert good.status_code == 200
    finally:
        for sock in stalled:
            sock.close()


def test_a_trickled_body_is_closed(guarded: Frontend) -> None:
    """One body byte every half second (each byte used to restart the silence deadline): under MIN_BODY_RATE, so
    closed at the first check, --header-timeout (2 s) after the headers; the trickle runs for at most 12 s."""
    trickling = [open_socket(guarded) for _ in range(5)]
    closed = [False] * len(trickling)
    try:
        for sock in trickling:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100000\r\n\r\n{")
        for _ in range(24):
            for index, sock in enumerate(trickling):
                if closed[index]:
                    continue
                try:
                    sock.sendall(b" ")
                    sock.settimeout(0.01)
                    closed[index] = sock.recv(1024) == b""
                except TimeoutError:
                    pass
                except OSError:  # reset or broken pipe: the server closed it
                    closed[index] = True
            if all(closed):
                break
            time.sleep(0.5)
        assert all(closed), closed
    finally:
        for sock in trickling:
            sock.close()


def listening(frontend: Proc, port: int) -> None:
    """Wait (bounded) until the front-end accepts connections; the probe connection is gone again after."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and frontend.popen.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    time.sleep(1.0)


def answer_to(port: int, request: bytes = b"GET /no-such-route HTTP/1.1\r\nHost: x\r\n\r\n") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.settimeout(5)
        sock.sendall(request)
        return sock.recv(4096)


def test_idle_connections_make_room_and_only_busy_ones_refuse(tmp_path: Path) -> None:
    """At --worker-connections a new client evicts the connection idle longest; only when every connection
    is serving a request (here: bodies still arriving) does it get 503 `too_many_conns` (no engine needed).
    A body that stopped arriving counts as idle after BODY_STALL_SECONDS (a slowloris after the headers held
    every slot until gunicorn's 120 s worker timeout)."""
    frontend = Frontend(f"ipc://{tmp_path}/no-engine.sock", tmp_path / "frontend.log", workers=1,
                        args=["--worker-connections", "20"])
    held: list[socket.socket] = []
    try:
        listening(frontend, frontend.port)
        held = [open_socket(frontend) for _ in range(20)]  # idle: connected, nothing sent
        time.sleep(0.5)
        assert answer_to(frontend.port).startswith(b"HTTP/1.1 404")
        assert closed_by_server(held[0])  # the oldest idle connection made room
        for sock in held:
            sock.close()
        time.sleep(0.5)
        held = [open_socket(frontend) for _ in range(20)]  # busy: headers sent, the body still coming
        for sock in held:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000\r\n\r\n{\"model\"")
        time.sleep(1.0)
        busy = answer_to(frontend.port)
        assert b"too_many_conns" in busy
        assert json.loads(busy.split(b"\r\n\r\n", 1)[1])["error"]["param"] is None  # OpenAI's envelope, whole
        # Bodies silent past BODY_STALL_SECONDS are no better than idle connections: the oldest makes room.
        time.sleep(BODY_STALL_SECONDS + 0.5)
        assert answer_to(frontend.port).startswith(b"HTTP/1.1 404")
        assert closed_by_server(held[0])
    finally:
        for sock in held:
            sock.close()
        frontend.stop()


def test_a_low_open_file_limit_lowers_the_cap_instead_of_failing_accept(tmp_path: Path) -> None:
    """Under `ulimit -n 256` (hard limit too) a cap of 1000 would run accept() into EMFILE: the worker holds
    its cap under the limit, so 300 idle connections leave a good client answered at once and no Errno 24."""
    port = free_port()
    limited = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
               "os.execv(sys.executable, [sys.executable, '-m', 'http_frontend.cli', *sys.argv[1:]])")
    frontend = Proc([sys.executable, "-c", limited, "--endpoint", f"ipc://{tmp_path}/no-engine.sock",
                     "--port", str(port), "--workers", "1", "--worker-connections", "1000"],
                    tmp_path / "frontend.log", dict(os.environ))
    held: list[socket.socket] = []
    try:
        listening(frontend, port)
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(sock)
        assert answer_to(port).startswith(b"HTTP/1.1 404")  # idle ones evicted under the lowered cap (log below)
    finally:
        for sock in held:
            sock.close()
        frontend.stop()
    log = frontend.log()
    assert "worker connections capped at 64" in log
    assert "Errno 24" not in log and "out of system resource" not in log
