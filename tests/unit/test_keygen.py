"""`engined keygen` writes CURVE certificates."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import zmq
import zmq.auth


def keygen(directory: Path, *clients: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "engine_daemon", "keygen", str(directory)]
    for name in clients:
        argv += ["--client", name]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_keygen_writes_server_and_client_certificates(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    result = keygen(directory)
    assert result.returncode == 0, result.stderr
    for name in ("server", "client"):
        public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert str(secret) in result.stdout and str(public) in result.stdout
        public_key, no_secret = zmq.auth.load_certificate(public)
        same_public, secret_key = zmq.auth.load_certificate(secret)
        assert no_secret is None and secret_key and public_key == same_public
    # The allow-list holds the client's public key only: copy it to the engine host as it is.
    allowed = directory / "authorized_clients"
    assert [p.name for p in allowed.iterdir()] == ["client.key"]
    assert zmq.auth.load_certificates(allowed) == {zmq.auth.load_certificate(directory / "client.key")[0]: True}
    assert "--curve-secret-key" in result.stdout and "--curve-client-key" in result.stdout

    # Never overwrites a key; adds a second client next to the same server key.
    server_before = (directory / "server.key_secret").read_bytes()
    again = keygen(directory)
    assert again.returncode != 0 and "not overwriting" in again.stderr
    assert keygen(directory, "second").returncode == 0
    assert (directory / "server.key_secret").read_bytes() == server_before
    assert sorted(p.name for p in allowed.iterdir()) == ["client.key", "second.key"]
