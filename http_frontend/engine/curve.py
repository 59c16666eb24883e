"""The front-end's half of CURVE: makes a worker's DEALER a CURVE client of the engine.

Settings come from the environment (the `frontend` command sets it from its
flags) because each gunicorn worker creates its own socket after the fork.
No mlx, no engine imports: front-ends stay light.
"""

from __future__ import annotations

import logging
import os

import zmq
import zmq.auth

log = logging.getLogger(__name__)

SERVER_KEY_ENV = "MLX_FRONTEND_CURVE_SERVER_KEY"
CLIENT_KEY_ENV = "MLX_FRONTEND_CURVE_CLIENT_KEY"


def apply_client_curve(sock: zmq.Socket, server_key: str | None = None, client_key: str | None = None) -> bool:
    """Sets CURVE client options on `sock` (before connect); False when CURVE is not configured.

    `server_key` is the engine's public certificate, `client_key` this front-end's
    secret certificate; both default to their environment variables. Raises
    ValueError when only one is given or a file holds the wrong half, so a
    misconfigured worker fails at start instead of silently never connecting.
    """
    server_key = server_key or os.environ.get(SERVER_KEY_ENV) or None
    client_key = client_key or os.environ.get(CLIENT_KEY_ENV) or None
    if server_key is None and client_key is None:
        return False
    if server_key is None or client_key is None:
        raise ValueError("--curve-server-key and --curve-client-key go together "
                         f"[{SERVER_KEY_ENV}, {CLIENT_KEY_ENV}]")
    server_public, _ = zmq.auth.load_certificate(server_key)
    client_public, client_secret = zmq.auth.load_certificate(client_key)
    if not client_secret:
        raise ValueError(f"--curve-client-key {client_key} holds no secret key (give the client's .key_secret file)")
    sock.curve_serverkey = server_public
    sock.curve_publickey = client_public
    sock.curve_secretkey = client_secret
    log.info("CURVE client: engine key from %s, client key from %s", server_key, client_key)
    return True


def check_key_files(server_keys: list[str], client_key: str | None) -> str | None:
    """Why the CURVE key files cannot work (for the command line's error), or None.

    Read once in the `frontend` command, so a wrong file is a one-line error at start rather than
    every worker failing to boot with a traceback. A server key file that holds the engine's secret
    half works but should not be on a front-end host: that is logged.
    """
    for path in (*server_keys, *([client_key] if client_key else [])):
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            return f"{path}: not a CURVE certificate ({exc})"
        if path == client_key and not secret:
            return f"--curve-client-key {path} holds no secret key (give the client's .key_secret file)"
        if path != client_key and secret:
            log.warning("--curve-server-key %s holds the engine's secret key: give the front-end its public "
                        "server.key only", path)
    return None
