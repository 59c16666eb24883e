"""`frontend`: run the HTTP front-end under gunicorn with N workers."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from http_frontend.engine import curve
from http_frontend.engine.pool_config import (
    DEFAULT_EPSILON,
    DEFAULT_MIN_BOUND,
    ENDPOINTS_ENV,
    EPSILON_ENV,
    MIN_BOUND_ENV,
    SERVER_KEYS_ENV,
    parse_specs,
    split_endpoints,
)
from http_frontend.gunicorn_settings import (
    APP,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE,
    DEFAULT_WORKER_CLASS,
    HEADER_TIMEOUT_ENV,
    KEEP_ALIVE_ENV,
    options,
)
from http_frontend.settings import add_flags, flags_to_env
from protocol.endpoints import ENDPOINT_ENV, default_endpoint


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="frontend",
        description="mlx-engined HTTP front-end: OpenAI-compatible routes relayed to engined. "
                    "Every flag has an environment variable equivalent (in brackets).")
    parser.add_argument("--endpoint", action="append", default=None, metavar="[NAME=]ENDPOINT",
                        help="engine endpoint to connect to (ipc:// or tcp://); repeat for several engines, which "
                             "requests are then routed between (cache affinity, bounded load, failover). NAME "
                             "(letters, digits, '-') is the engine's id in X-Engine-Id, response ids, /health and "
                             "metrics: give "
                             "each engine the same name on every front-end host (default: a digest of the endpoint). "
                             f"[{ENDPOINTS_ENV}, os.pathsep- or comma-separated; or {ENDPOINT_ENV} for one] "
                             f"(default: {default_endpoint()})")
    parser.add_argument("--routing-epsilon", type=float, default=float(env(EPSILON_ENV) or DEFAULT_EPSILON),
                        help="bounded-load slack: an engine holding more than "
                             "ceil((1 + EPSILON) x (total load + 1) / engines) requests is passed over for the "
                             "next in the request's rendezvous order (only with several engines). "
                             f"[{EPSILON_ENV}] (default: %(default)s)")
    parser.add_argument("--routing-min-bound", type=int, default=int(env(MIN_BOUND_ENV) or DEFAULT_MIN_BOUND),
                        help="an engine is never passed over for load while it holds fewer than this many requests "
                             "(a few more in one decode batch cost less than a conversation's prompt re-read "
                             f"elsewhere). [{MIN_BOUND_ENV}] (default: %(default)s)")
    parser.add_argument("--host", default=env("MLX_FRONTEND_HOST", "127.0.0.1"),
                        help="address to listen on. [MLX_FRONTEND_HOST] (default: %(default)s)")
    parser.add_argument("--port", type=int, default=int(env("MLX_FRONTEND_PORT", "8080")),
                        help="port to listen on. [MLX_FRONTEND_PORT] (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=int(env("MLX_FRONTEND_WORKERS", "2")),
                        help="gunicorn worker processes. [MLX_FRONTEND_WORKERS] (default: %(default)s)")
    parser.add_argument("--worker-class", default=env("MLX_FRONTEND_WORKER_CLASS", DEFAULT_WORKER_CLASS),
                        help="gunicorn worker class: the default is gunicorn's native asyncio 'asgi' worker with "
                             "a header deadline and a connection cap; 'asgi' or 'uvicorn_worker.UvicornWorker' "
                             "also work. [MLX_FRONTEND_WORKER_CLASS] (default: %(default)s)")
    parser.add_argument("--header-timeout", type=float,
                        default=float(env(HEADER_TIMEOUT_ENV) or DEFAULT_HEADER_TIMEOUT),
                        help="seconds a new connection has to send its request headers, and a request body may "
                             "stay silent (or average under 1 KB/s), before it is closed (slowloris). "
                             f"[{HEADER_TIMEOUT_ENV}] "
                             "(default: %(default)s)")
    parser.add_argument("--keep-alive", type=int, default=int(env(KEEP_ALIVE_ENV) or DEFAULT_KEEP_ALIVE),
                        help="seconds an idle kept-alive connection stays open (0: one request per connection). "
                             f"[{KEEP_ALIVE_ENV}] (default: %(default)s)")
    parser.add_argument("--worker-connections", type=int, default=int(env("MLX_FRONTEND_WORKER_CONNECTIONS", "1000")),
                        help="open connections one worker keeps (under the open-file limit); past it a new one "
                             "evicts the longest-idle connection, or gets 503 when all are serving requests. "
                             "[MLX_FRONTEND_WORKER_CONNECTIONS] (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=float(env("MLX_FRONTEND_REQUEST_TIMEOUT", "600")),
                        help="seconds a request may wait for the engine to start it or to produce output. "
                             "[MLX_FRONTEND_REQUEST_TIMEOUT] (default: %(default)s)")
    parser.add_argument("--graceful-timeout", type=int, default=int(env("MLX_FRONTEND_GRACEFUL_TIMEOUT", "30")),
                        help="seconds old workers get to finish streams on reload/stop. "
                             "[MLX_FRONTEND_GRACEFUL_TIMEOUT] (default: %(default)s)")
    parser.add_argument("--log-level", default=env("MLX_FRONTEND_LOG_LEVEL", "info"),
                        help="gunicorn log level. [MLX_FRONTEND_LOG_LEVEL] (default: %(default)s)")
    parser.add_argument("--pid-file", default=env("MLX_FRONTEND_PID_FILE"),
                        help="write the gunicorn master's pid here (for HUP reloads). [MLX_FRONTEND_PID_FILE]")
    parser.add_argument("--curve-server-key", action="append", default=None,
                        help="the engine's public CURVE certificate (server.key from `engined keygen`): encrypt "
                             "and authenticate the engine connection, for tcp:// across hosts. Give it once for "
                             "engines that share a key, or once per --endpoint, in the same order. "
                             f"[{curve.SERVER_KEY_ENV}; per engine: {SERVER_KEYS_ENV}, os.pathsep-separated]")
    parser.add_argument("--curve-client-key", default=env(curve.CLIENT_KEY_ENV),
                        help="this front-end's secret CURVE certificate (client.key_secret from `engined keygen`), "
                             "whose public half is in the engine's --curve-authorized-keys. "
                             f"[{curve.CLIENT_KEY_ENV}]")
    add_flags(parser)  # API keys, CORS and request limits (`FrontendSettings`)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    endpoints = args.endpoint or split_endpoints(os.environ.get(ENDPOINTS_ENV, "")) or [default_endpoint()]
    server_keys = args.curve_server_key or [k for k in os.environ.get(SERVER_KEYS_ENV, "").split(os.pathsep) if k] \
        or ([os.environ[curve.SERVER_KEY_ENV]] if os.environ.get(curve.SERVER_KEY_ENV) else [])
    if bool(server_keys) != bool(args.curve_client_key):
        parser.error("--curve-server-key and --curve-client-key go together")
    for key in (*server_keys, args.curve_client_key):
        if key and not os.path.isfile(key):
            parser.error(f"{key}: no such file")
    if (wrong := curve.check_key_files(server_keys, args.curve_client_key)) is not None:
        parser.error(wrong)
    try:
        parse_specs(endpoints, server_keys)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.routing_epsilon > 0:
        parser.error("--routing-epsilon must be positive")
    if args.routing_min_bound < 1:
        parser.error("--routing-min-bound must be at least 1")
    server_keys = [os.path.abspath(k) for k in server_keys]
    # Workers read their settings from the environment (inherited across the fork and HUP reloads).
    os.environ.update({
        ENDPOINT_ENV: endpoints[0],
        ENDPOINTS_ENV: os.pathsep.join(endpoints) if len(endpoints) > 1 else "",
        EPSILON_ENV: str(args.routing_epsilon),
        MIN_BOUND_ENV: str(args.routing_min_bound),
        "MLX_FRONTEND_HOST": args.host,
        "MLX_FRONTEND_PORT": str(args.port),
        "MLX_FRONTEND_WORKERS": str(args.workers),
        "MLX_FRONTEND_WORKER_CLASS": args.worker_class,
        HEADER_TIMEOUT_ENV: str(args.header_timeout),
        "MLX_FRONTEND_WORKER_CONNECTIONS": str(args.worker_connections),
        KEEP_ALIVE_ENV: str(args.keep_alive),
        "MLX_FRONTEND_REQUEST_TIMEOUT": str(args.request_timeout),
        "MLX_FRONTEND_GRACEFUL_TIMEOUT": str(args.graceful_timeout),
        "MLX_FRONTEND_LOG_LEVEL": args.log_level,
        # absolute: a HUP reload or a gunicorn --chdir must not change which key file is read
        curve.SERVER_KEY_ENV: server_keys[0] if len(server_keys) == 1 else "",
        SERVER_KEYS_ENV: os.pathsep.join(server_keys) if len(server_keys) > 1 else "",
        curve.CLIENT_KEY_ENV: os.path.abspath(args.curve_client_key) if args.curve_client_key else "",
    })
    os.environ.update(flags_to_env(args))
    from gunicorn.app.base import BaseApplication  # gunicorn only once the flags are good: a fast --help
    from gunicorn.util import import_app

    settings = options()
    if args.pid_file:
        settings["pidfile"] = args.pid_file

    class FrontendApplication(BaseApplication):
        def load_config(self) -> None:
            for key, value in settings.items():
                if key in self.cfg.settings:  # older gunicorn lacks some settings
                    self.cfg.set(key, value)

        def load(self) -> Any:
            # By name, in each worker, as `gunicorn APP` does: the master never imports the app, so
            # every worker (those a HUP starts included) imports the routes as installed at its start.
            return import_app(APP)

    FrontendApplication().run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
