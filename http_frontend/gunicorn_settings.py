"""Gunicorn settings shared by the `frontend` command and the deploy folder's gunicorn config.

Read from the environment so both ways of starting the front-end agree.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

APP = "http_frontend.app:create_app()"
# Seconds a new connection has to send its request headers (`GuardedProtocol`).
HEADER_TIMEOUT_ENV = "MLX_FRONTEND_HEADER_TIMEOUT"
DEFAULT_HEADER_TIMEOUT = 10.0
KEEP_ALIVE_ENV = "MLX_FRONTEND_KEEP_ALIVE"
DEFAULT_KEEP_ALIVE = 5
# The directory one master's workers share their engines' catalogues in (`engine.catalogues`), made by the master.
SHARED_DIR_ENV = "MLX_FRONTEND_SHARED_DIR"

# gunicorn's native asyncio ASGI worker (lifespan support, no extra dependency) with a header deadline,
# a connection cap and quiet logs (`GuardedASGIWorker`).
DEFAULT_WORKER_CLASS = "http_frontend.middleware.connections.GuardedASGIWorker"


# gunicorn's default access line without `%(u)s` (the Basic-auth user name: an API key sent with `curl -u`) and
# without the query string (`?api_key=…` is refused, but the key would be logged): method, path, protocol.
ACCESS_LOG_FORMAT = '%(h)s %(l)s - %(t)s "%(m)s %(U)s %(H)s" %(s)s %(b)s "%(f)s" "%(a)s"'


def make_shared_dir(server: Any) -> None:
    """gunicorn `on_starting` (in the master, before any worker): the directory its workers share the
    engines' catalogues in (`Catalogues`), so a worker started after an engine died knows what it served."""
    if not os.environ.get(SHARED_DIR_ENV):
        os.environ[SHARED_DIR_ENV] = tempfile.mkdtemp(prefix="mlx-frontend-")  # 0700: this user's workers only
        os.environ[SHARED_DIR_ENV + "_OWNED"] = str(os.getpid())


def remove_shared_dir(server: Any) -> None:
    """gunicorn `on_exit`: the directory made by `make_shared_dir` of this master goes with it."""
    if os.environ.get(SHARED_DIR_ENV + "_OWNED") == str(os.getpid()):
        shutil.rmtree(os.environ.get(SHARED_DIR_ENV, ""), ignore_errors=True)


def options() -> dict[str, Any]:
    host = os.environ.get("MLX_FRONTEND_HOST", "127.0.0.1")
    port = os.environ.get("MLX_FRONTEND_PORT", "8080")
    return {
        "bind": [f"{host}:{port}"],
        "workers": int(os.environ.get("MLX_FRONTEND_WORKERS", "2")),
        "worker_class": os.environ.get("MLX_FRONTEND_WORKER_CLASS", DEFAULT_WORKER_CLASS),
        # Streams can be long: the arbiter's worker timeout must not kill a busy worker.
        "timeout": int(os.environ.get("MLX_FRONTEND_WORKER_TIMEOUT", "120")),
        # On HUP/TERM, in-flight streams get this long to finish on the old workers.
        "graceful_timeout": int(os.environ.get("MLX_FRONTEND_GRACEFUL_TIMEOUT", "30")),
        # Seconds an idle kept-alive connection stays open (it also bounds the wait for a later request's headers).
        "keepalive": int(os.environ.get(KEEP_ALIVE_ENV) or DEFAULT_KEEP_ALIVE),
        "worker_connections": int(os.environ.get("MLX_FRONTEND_WORKER_CONNECTIONS", "1000")),
        "loglevel": os.environ.get("MLX_FRONTEND_LOG_LEVEL", "info").lower(),
        "accesslog": os.environ.get("MLX_FRONTEND_ACCESS_LOG", "-"),
        # gunicorn's default names the Basic-auth user, and a key sent as `curl -u sk-...:` is that user.
        "access_log_format": ACCESS_LOG_FORMAT,
        "errorlog": "-",
        "preload_app": False,  # each worker creates its own ZMQ socket after the fork
        # gunicorn >= 24 opens a control socket at one per-user path: two front-ends would collide.
        "control_socket_disable": True,
        "on_starting": make_shared_dir,
        "on_exit": remove_shared_dir,
    }
