"""Who may talk to the engine's ROUTER: CURVE encryption, a key allow-list, and `engined keygen`.

The engine runs arbitrary prompts on whatever model it holds, so its socket must
not be open to a network unless every peer is authenticated. ZeroMQ's CURVE
gives both encryption and authentication: the engine proves it holds the server
secret key, each front-end proves it holds a client secret key whose public half
the operator put in the allow-list directory (checked by a ZAP handler thread).

Local transports (ipc://, whose directory is 0700, and loopback tcp) are left
plain; any other endpoint without CURVE is refused unless the operator says
`--allow-insecure-tcp`. Nothing here imports mlx, so `engined keygen` is instant.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

SECRET_KEY_ENV = "MLX_ENGINE_CURVE_SECRET_KEY"
AUTHORIZED_KEYS_ENV = "MLX_ENGINE_CURVE_AUTHORIZED_KEYS"
ALLOW_INSECURE_ENV = "MLX_ENGINE_ALLOW_INSECURE_TCP"

SERVER_NAME = "server"
AUTHORIZED_DIR = "authorized_clients"
_LOCAL_HOSTS = {"localhost", "ip6-localhost"}


class InsecureEndpoint(RuntimeError):
    """A network endpoint would be bound without CURVE, or the CURVE settings are unusable."""


@dataclass(frozen=True)
class SocketSecurity:
    """The engine's socket-security settings, as given by flags or environment."""

    secret_key: Path | None = None  # the server's secret certificate (server.key_secret)
    authorized_keys: Path | None = None  # directory of the allowed front-ends' public certificates (*.key)
    allow_insecure_tcp: bool = False

    @property
    def curve(self) -> bool:
        return self.secret_key is not None


def is_local_endpoint(endpoint: str) -> bool:
    """ipc://, inproc:// and tcp:// on a loopback address: reachable from this host only.

    Anything else (a wildcard, a hostname, an interface name, another transport) is
    treated as reachable from the network: a conservative guess costs one flag.
    """
    transport, _, address = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    if host.lower() in _LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, security: SocketSecurity) -> None:
    """Raises InsecureEndpoint when binding `endpoint` with `security` would be unsafe or cannot work."""
    if (security.secret_key is None) != (security.authorized_keys is None):
        raise InsecureEndpoint("--curve-secret-key and --curve-authorized-keys go together: the first "
                               "encrypts, the second says which front-ends may connect")
    if security.curve:
        if not zmq.has("curve"):
            raise InsecureEndpoint("this libzmq was built without CURVE support")
        if not security.secret_key.is_file():
            raise InsecureEndpoint(f"--curve-secret-key {security.secret_key}: no such file")
        if not security.authorized_keys.is_dir():
            raise InsecureEndpoint(f"--curve-authorized-keys {security.authorized_keys}: no such directory")
        return
    if not is_local_endpoint(endpoint) and not security.allow_insecure_tcp:
        raise InsecureEndpoint(
            f"refusing to bind {endpoint} without CURVE: anyone who can reach it could use the engine. "
            "Create keys with `engined keygen DIR` and pass --curve-secret-key and --curve-authorized-keys, "
            "bind ipc:// or tcp://127.0.0.1 instead, or pass --allow-insecure-tcp "
            f"[{ALLOW_INSECURE_ENV}=1] on a trusted network")


def secure_router(context: zmq.Context, router: zmq.Socket, endpoint: str,
                  security: SocketSecurity) -> ThreadAuthenticator | None:
    """Makes `router` a CURVE server with a ZAP allow-list; call before bind.

    Returns the authenticator thread (stop it before terminating the context), or
    None when the socket stays plain.
    """
    check_endpoint(endpoint, security)
    if not security.curve:
        if not is_local_endpoint(endpoint):
            log.warning("binding %s WITHOUT encryption or authentication (--allow-insecure-tcp)", endpoint)
        return None
    public, secret = zmq.auth.load_certificate(security.secret_key)
    if not secret:
        raise InsecureEndpoint(f"--curve-secret-key {security.secret_key} holds no secret key "
                               "(give the server's .key_secret file, not its public .key)")
    allowed = zmq.auth.load_certificates(security.authorized_keys)
    if not allowed:
        log.warning("no *.key files in %s: no front-end can connect", security.authorized_keys)
    auth = ThreadAuthenticator(context, log=logging.getLogger("engined.zap"))
    auth.start()
    auth.configure_curve(domain="*", location=str(security.authorized_keys))
    router.curve_secretkey = secret
    router.curve_publickey = public
    router.curve_server = True
    log.info("CURVE on %s: %d authorized front-end key(s) from %s (read at start)", endpoint, len(allowed),
             security.authorized_keys)
    return auth


# -- engined keygen ---------------------------------------------------------------------------------------------
def _write_certificate(path: Path, public: bytes, secret: bytes | None) -> None:
    """A ZPL certificate in the format zmq.auth.create_certificates writes and load_certificate reads.

    Written by hand so a secret file is created 0600 from the start (never briefly
    readable under the umask), and an existing file is never overwritten, so a key
    in use cannot be replaced by mistake.
    """
    banner = ("#   ZeroMQ CURVE **Secret** Certificate (engined keygen): DO NOT PROVIDE THIS FILE TO OTHER USERS"
              if secret else "#   ZeroMQ CURVE Public Certificate (engined keygen)")
    lines = [banner, "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    mode = 0o600 if secret else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")


def create_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """NAME.key (public) and NAME.key_secret (0600) in `directory`; refuses to overwrite."""
    if not name or name.startswith(".") or Path(name).name != name:
        raise ValueError(f"key name {name!r}: use a plain file name")
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    for existing in (public_file, secret_file):
        if existing.exists():
            raise FileExistsError(f"{existing} exists: not overwriting a key")
    public, secret = zmq.curve_keypair()
    _write_certificate(secret_file, public, secret)
    _write_certificate(public_file, public, None)
    return public_file, secret_file


def keygen(directory: Path, clients: list[str]) -> dict[str, Path]:
    """Server key pair (kept if it exists), one pair per client, and the allow-list directory.

    Why the allow-list is a copy: the engine host needs only public client keys, so
    `authorized_clients/` can be copied there without any front-end secret.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    allow = directory / AUTHORIZED_DIR
    allow.mkdir(mode=0o700, exist_ok=True)
    files: dict[str, Path] = {}
    if not (directory / f"{SERVER_NAME}.key_secret").exists():
        create_keypair(directory, SERVER_NAME)
    files["server public"] = directory / f"{SERVER_NAME}.key"
    files["server secret"] = directory / f"{SERVER_NAME}.key_secret"
    for name in clients:
        public, secret = create_keypair(directory, name)
        (allow / public.name).write_bytes(public.read_bytes())
        files[f"{name} public"], files[f"{name} secret"] = public, secret
    files["authorized clients"] = allow
    return files


def keygen_main(argv: list[str]) -> int:
    """`engined keygen DIR [--client NAME ...]`: prints which file goes where."""
    parser = argparse.ArgumentParser(
        prog="engined keygen",
        description="Create CURVE certificates for engine <-> front-end traffic across hosts: a server key "
                    "pair (kept if DIR already has one), a key pair per front-end client, and "
                    f"DIR/{AUTHORIZED_DIR}/ holding the clients' public keys (the engine's allow-list). "
                    "Secret files are created mode 0600; existing client keys are never overwritten.")
    parser.add_argument("directory", type=Path, help="where to write the certificates (created 0700)")
    parser.add_argument("--client", action="append", dest="clients", metavar="NAME",
                        help="client key pair name; repeat for several front-end hosts (default: client)")
    args = parser.parse_args(argv)
    clients = args.clients or ["client"]
    try:
        files = keygen(args.directory, clients)
    except (OSError, ValueError) as exc:
        print(f"engined keygen: {exc}", file=sys.stderr)
        return 1
    for label, path in files.items():
        print(f"{label:>22}: {path}")
    d = args.directory
    first = clients[0]
    print(f"\nengine host:    engined --endpoint tcp://0.0.0.0:5555 --curve-secret-key {d / 'server.key_secret'} "
          f"--curve-authorized-keys {d / AUTHORIZED_DIR}")
    print(f"front-end host: frontend --endpoint tcp://ENGINE_HOST:5555 --curve-server-key {d / 'server.key'} "
          f"--curve-client-key {d / (first + '.key_secret')}")
    print("Copy only the files each host needs; *.key_secret files must stay private.")
    return 0
