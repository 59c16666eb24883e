"""CURVE across hosts, with real processes and sockets: keygen, allow-list, front-end, insecure-bind refusal."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, free_port, ping_engine


def keygen(directory: Path, *clients: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "engine_daemon", "keygen", str(directory)]
    for name in clients:
        argv += ["--client", name]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def curve_ping(endpoint: str, server_key: Path, client_key: Path, timeout: float = 1.0) -> dict | None:
    """PONG body over a CURVE DEALER using `client_key` (a .key_secret), or None without an answer."""
    return ping_engine(endpoint, timeout, curve=(server_key, client_key))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("curve") / "keys"
    result = keygen(directory, "frontend")
    assert result.returncode == 0, result.stderr
    return directory


@pytest.fixture(scope="module")
def intruder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A well-formed client key pair that is not in the engine's allow-list."""
    directory = tmp_path_factory.mktemp("intruder") / "keys"
    assert keygen(directory).returncode == 0
    return directory / "client.key_secret"


@pytest.fixture(scope="module")
def curve_engine(tiny_model: Path, keys: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    logs = tmp_path_factory.mktemp("curve-logs")
    engine = Engine(f"tcp://127.0.0.1:{free_port()}", logs / "engined.log", model=str(tiny_model),
                    args=["--curve-secret-key", str(keys / "server.key_secret"),
                          "--curve-authorized-keys", str(keys / "authorized_clients")])
    try:
        deadline = time.monotonic() + 60
        while True:
            assert engine.popen.poll() is None, engine.log()
            pong = curve_ping(engine.endpoint, keys / "server.key", keys / "frontend.key_secret", 0.5)
            if pong and pong["state"] == "ready":
                break
            assert time.monotonic() < deadline, engine.log()
            time.sleep(0.1)
        yield engine
    finally:
        engine.stop()


def test_authorized_client_gets_pong_others_get_nothing(curve_engine: Engine, keys: Path, intruder: Path) -> None:
    pong = curve_ping(curve_engine.endpoint, keys / "server.key", keys / "frontend.key_secret", 2.0)
    assert pong is not None and pong["state"] == "ready"

    started = time.monotonic()
    assert curve_ping(curve_engine.endpoint, keys / "server.key", intruder, 2.0) is None
    assert time.monotonic() - started >= 1.9
    assert ping_engine(curve_engine.endpoint, 2.0) is None  # plain, no CURVE at all

    # Denied peers cost the engine nothing: authorized clients are still served.
    assert curve_ping(curve_engine.endpoint, keys / "server.key", keys / "frontend.key_secret", 2.0) is not None
    assert "CURVE on tcp://127.0.0.1" in curve_engine.log()
    # Red team: neither side logged why; the engine now says (rate-limited) what it refused.
    wait_for_line(curve_engine.log, "CURVE handshake was refused: a front-end key not in --curve-authorized-keys")
    wait_for_line(curve_engine.log, "CURVE handshake failed")  # the plain one


def wait_for_line(log: Callable[[], str], line: str, timeout: float = 20.0) -> None:
    """Waits for the process to log `line` (its log is what it reports; no client clock is judged)."""
    deadline = time.monotonic() + timeout
    while line not in log():
        assert time.monotonic() < deadline, f"{line!r} never logged:\n{log()[-3000:]}"
        time.sleep(0.1)


def test_a_frontend_with_a_key_the_engine_refuses_says_so(curve_engine: Engine, keys: Path, intruder: Path,
                                                            tmp_path: Path) -> None:
    frontend = Frontend(curve_engine.endpoint, tmp_path / "frontend.log", workers=1,
                        args=["--curve-server-key", str(keys / "server.key"), "--curve-client-key", str(intruder)])
    try:
        wait_for_line(frontend.log, f"CURVE handshake with the engine at {curve_engine.endpoint} was refused")
    finally:
        frontend.stop()


def test_frontend_with_client_keys_serves_chat(curve_engine: Engine, keys: Path, tmp_path: Path) -> None:
    frontend = Frontend(curve_engine.endpoint, tmp_path / "frontend.log", workers=1,
                        args=["--curve-server-key", str(keys / "server.key"),
                              "--curve-client-key", str(keys / "frontend.key_secret")])
    try:
        health = frontend.wait_healthy()
        assert health["status"] == "healthy" and health["engine"]["state"] == "ready"
        r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30, json={
            "model": "default", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    finally:
        frontend.stop()


def test_frontend_without_keys_cannot_reach_a_curve_engine(curve_engine: Engine, tmp_path: Path) -> None:
    frontend = Frontend(curve_engine.endpoint, tmp_path / "frontend.log", workers=1)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                health = httpx.get(f"{frontend.base_url}/health", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, frontend.log()
                time.sleep(0.2)
        time.sleep(1.0)
        health = httpx.get(f"{frontend.base_url}/health", timeout=5)
        assert health.status_code == 503
    finally:
        frontend.stop()


def test_frontend_refuses_half_a_curve_configuration(keys: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "http_frontend.cli", "--endpoint", "tcp://127.0.0.1:1",
                             "--curve-server-key", str(keys / "server.key")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "go together" in result.stderr


def test_frontend_refuses_wrong_key_files_in_one_line(keys: Path, tmp_path: Path) -> None:
    """Red team: a public key as --curve-client-key or a garbage server key failed every worker's boot with a
    traceback; they are now refused by the command, naming the file."""
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a certificate\n")
    for server, client, expected in ((keys / "server.key", keys / "frontend.key", "holds no secret key"),
                                     (garbage, keys / "frontend.key_secret", "not a CURVE certificate")):
        result = subprocess.run([sys.executable, "-m", "http_frontend.cli", "--endpoint", "tcp://127.0.0.1:1",
                                 "--curve-server-key", str(server), "--curve-client-key", str(client)],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and expected in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_engine_refuses_plain_tcp_on_all_interfaces_unless_allowed(tmp_path: Path) -> None:
    port = free_port()
    refused = Engine(f"tcp://0.0.0.0:{port}", tmp_path / "refused.log")
    try:
        assert refused.popen.wait(60) != 0
    finally:
        refused.stop()
    assert "refusing to bind tcp://0.0.0.0" in refused.log() and "--allow-insecure-tcp" in refused.log()

    # Half a CURVE configuration is refused too: encryption without an allow-list would admit anyone.
    half = Engine(f"tcp://0.0.0.0:{port}", tmp_path / "half.log", args=["--curve-secret-key", "/nonexistent"])
    try:
        assert half.popen.wait(60) != 0
    finally:
        half.stop()
    assert "go together" in half.log()

    allowed = Engine(f"tcp://0.0.0.0:{port}", tmp_path / "allowed.log", args=["--allow-insecure-tcp"])
    try:
        allowed.endpoint = f"tcp://127.0.0.1:{port}"
        assert allowed.wait_ready(model_loaded=False)["state"] == "idle"
        assert "WITHOUT encryption or authentication" in allowed.log()
    finally:
        allowed.stop()
