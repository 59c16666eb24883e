"""`engined`: the daemon that owns the MLX model and serves front-ends over ZeroMQ."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from protocol.endpoints import ENDPOINT_ENV, default_endpoint


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def _path_or_none(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None


def _size(value: str | None) -> int | None:
    """'2GB', '512MB', '1048576' -> bytes."""
    if not value:
        return None
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    text = value.strip().upper().replace("IB", "B")
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engined",
        description="mlx-engined daemon: loads an MLX model and streams generations to front-ends "
                    "over ZeroMQ. Every flag has an environment variable equivalent (in brackets).",
        epilog="`engined keygen DIR` creates CURVE certificates for tcp:// across hosts "
               "(see `engined keygen --help`).",
    )
    parser.add_argument("--model", default=os.environ.get("MLX_ENGINE_MODEL"),
                        help="model to load at start: a Hugging Face repo id (local cache first, then "
                             "downloaded) or a local directory. Optional: without it the first request's "
                             "'model' loads one. [MLX_ENGINE_MODEL]")
    parser.add_argument("--endpoint", default=default_endpoint(),
                        help=f"ZeroMQ endpoint to bind: ipc://PATH or tcp://HOST:PORT. [{ENDPOINT_ENV}] "
                             "(default: %(default)s)")
    parser.add_argument("--allow-download", action="store_true", default=_env_flag("MLX_ENGINE_ALLOW_DOWNLOAD"),
                        help="let request 'model' names download from the Hugging Face Hub when they are not "
                             "cached (the --model given at start is always fetched if missing). "
                             "[MLX_ENGINE_ALLOW_DOWNLOAD=1]")
    parser.add_argument("--model-dir", action="append", metavar="DIR",
                        help="directory of model directories that requests may name (relative to it, or by an "
                             "absolute path inside it); repeat for several. Other local paths in requests get 400. "
                             "[MLX_ENGINE_MODEL_DIRS, os.pathsep-separated]")
    parser.add_argument("--trust-remote-code", action="store_true", default=_env_flag("MLX_TRUST_REMOTE_CODE"),
                        help="let models run the Python code they ship (mlx_lm trust_remote_code). Off by default: "
                             "only for models you trust. [MLX_TRUST_REMOTE_CODE=1]")
    parser.add_argument("--default-max-tokens", type=int,
                        default=int(os.environ.get("MLX_ENGINE_DEFAULT_MAX_TOKENS", "4096")),
                        help="max_tokens for requests that give none; capped by the context window. "
                             "[MLX_ENGINE_DEFAULT_MAX_TOKENS] (default: %(default)s)")
    parser.add_argument("--prefill-step-size", type=int, default=int(os.environ.get("PREFILL_STEP_SIZE", "2048")),
                        help="prompt tokens processed per model call. [PREFILL_STEP_SIZE] (default: %(default)s)")
    parser.add_argument("--interleave-prefill-tokens", type=int,
                        default=int(os.environ.get("MLX_ENGINE_INTERLEAVE_PREFILL_TOKENS", "0")),
                        help="prompt tokens prefilled per step while other requests decode, so a long prompt "
                             "does not stall running streams; 0 sizes the chunk from measured step times so a "
                             "step with prefill costs about one extra decode step. "
                             "[MLX_ENGINE_INTERLEAVE_PREFILL_TOKENS] (default: %(default)s)")
    parser.add_argument("--decode-concurrency", type=int,
                        default=int(os.environ.get("MLX_ENGINE_DECODE_CONCURRENCY", "32")),
                        help="most requests decoding in one batch. [MLX_ENGINE_DECODE_CONCURRENCY] "
                             "(default: %(default)s)")
    parser.add_argument("--prompt-concurrency", type=int,
                        default=int(os.environ.get("MLX_ENGINE_PROMPT_CONCURRENCY", "8")),
                        help="most prompts prefilled together. [MLX_ENGINE_PROMPT_CONCURRENCY] (default: %(default)s)")
    parser.add_argument("--max-queued", type=int, default=int(os.environ.get("MLX_ENGINE_MAX_QUEUED", "256")),
                        help="requests waiting to start before new ones get 429. [MLX_ENGINE_MAX_QUEUED] "
                             "(default: %(default)s)")
    parser.add_argument("--prompt-cache-size", type=int,
                        default=int(os.environ.get("MLX_ENGINE_PROMPT_CACHE_SIZE", "10")),
                        help="most prefix-cache entries (LRU). [MLX_ENGINE_PROMPT_CACHE_SIZE] (default: %(default)s)")
    parser.add_argument("--prompt-cache-bytes", type=_size, default=_size(os.environ.get("MLX_ENGINE_PROMPT_CACHE_BYTES")),
                        help="byte cap of the prefix cache, e.g. 2GB or 512MB (default: a quarter of "
                             "--memory-budget, else unbounded). [MLX_ENGINE_PROMPT_CACHE_BYTES]")
    parser.add_argument("--max-kv-size", type=int, default=_int_or_none(os.environ.get("MAX_KV_SIZE")),
                        help="rotating KV cache of this many tokens per request (default: off). [MAX_KV_SIZE]")
    parser.add_argument("--kv-bits", type=int, default=_int_or_none(os.environ.get("KV_BITS")),
                        help="quantize the KV cache to this many bits (default: off). mlx-lm cannot batch a "
                             "quantized cache: requests then run one at a time, as the log and /stats say. [KV_BITS]")
    parser.add_argument("--kv-group-size", type=int, default=int(os.environ.get("KV_GROUP_SIZE", "64")),
                        help="group size of KV quantization. [KV_GROUP_SIZE] (default: %(default)s)")
    parser.add_argument("--quantized-kv-start", type=int, default=int(os.environ.get("QUANTIZED_KV_START", "5000")),
                        help="tokens after which the KV cache is quantized. [QUANTIZED_KV_START] (default: %(default)s)")
    parser.add_argument("--memory-budget", type=float, default=_env_float("MLX_ENGINE_MEMORY_BUDGET"),
                        help="GB the engine may use (weights + KV + caches). Requests whose KV would not fit get "
                             "400 memory_budget_exceeded before generating, and MLX's memory limit is set to it. "
                             "[MLX_ENGINE_MEMORY_BUDGET]")
    parser.add_argument("--temperature", type=float, default=_env_float("MLX_ENGINE_TEMPERATURE"),
                        help="default temperature when neither the request nor the model's "
                             "generation_config.json sets one (then 1.0). [MLX_ENGINE_TEMPERATURE]")
    parser.add_argument("--top-p", type=float, default=_env_float("MLX_ENGINE_TOP_P"),
                        help="default top_p, as --temperature. [MLX_ENGINE_TOP_P]")
    parser.add_argument("--peer-timeout", type=float, default=float(os.environ.get("MLX_ENGINE_PEER_TIMEOUT", "10")),
                        help="seconds of silence after which a front-end's requests are aborted. "
                             "[MLX_ENGINE_PEER_TIMEOUT] (default: %(default)s)")
    parser.add_argument("--stall-timeout", type=float,
                        default=float(os.environ.get("MLX_ENGINE_STALL_TIMEOUT", "60")),
                        help="seconds one step (or command) of the mlx thread may run before the engine reports "
                             "itself 'stalled' in pings and /health (model loads excepted). "
                             "[MLX_ENGINE_STALL_TIMEOUT] (default: %(default)s)")
    parser.add_argument("--responses-ttl", type=float,
                        default=float(os.environ.get("MLX_ENGINE_RESPONSES_TTL", "3600")),
                        help="seconds a stored Responses API response stays resumable (previous_response_id) "
                             "and retrievable; the store is in memory and an engine restart loses it. "
                             "[MLX_ENGINE_RESPONSES_TTL] (default: %(default)s)")
    parser.add_argument("--responses-max-bytes", type=_size,
                        default=_size(os.environ.get("MLX_ENGINE_RESPONSES_MAX_BYTES") or "64MB"),
                        help="byte cap of the Responses API store, e.g. 64MB; the oldest responses are evicted "
                             "first. [MLX_ENGINE_RESPONSES_MAX_BYTES] (default: 64MB)")
    parser.add_argument("--curve-secret-key", type=Path, default=_path_or_none("MLX_ENGINE_CURVE_SECRET_KEY"),
                        help="the engine's secret CURVE certificate (server.key_secret from `engined keygen`): "
                             "encrypt the socket and authenticate front-ends; needs --curve-authorized-keys. "
                             "[MLX_ENGINE_CURVE_SECRET_KEY]")
    parser.add_argument("--curve-authorized-keys", type=Path,
                        default=_path_or_none("MLX_ENGINE_CURVE_AUTHORIZED_KEYS"),
                        help="directory of the public certificates (*.key) of the front-ends allowed to connect, "
                             "read at start. [MLX_ENGINE_CURVE_AUTHORIZED_KEYS]")
    parser.add_argument("--allow-insecure-tcp", action="store_true", default=_env_flag("MLX_ENGINE_ALLOW_INSECURE_TCP"),
                        help="bind a non-loopback tcp:// endpoint without CURVE (refused otherwise): only on a "
                             "network you trust. [MLX_ENGINE_ALLOW_INSECURE_TCP=1]")
    parser.add_argument("--log-level", default=os.environ.get("MLX_ENGINE_LOG_LEVEL", "INFO"),
                        help="logging level. [MLX_ENGINE_LOG_LEVEL] (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        from engine_daemon.socket_security import keygen_main
        return keygen_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s engined[%(process)d] %(name)s: %(message)s")
    log = logging.getLogger("engined")
    # Refused before mlx loads or a model downloads: a misconfigured socket is an operator error.
    from engine_daemon.model_store import model_roots
    from engine_daemon.socket_security import InsecureEndpoint, SocketSecurity, check_endpoint
    security = SocketSecurity(args.curve_secret_key, args.curve_authorized_keys, args.allow_insecure_tcp)
    try:
        check_endpoint(args.endpoint, security)
    except InsecureEndpoint as exc:
        log.error("%s", exc)
        return 2
    roots = model_roots(args.model_dir or os.environ.get("MLX_ENGINE_MODEL_DIRS", "").split(os.pathsep))
    missing = [str(root) for root in roots if not root.is_dir()]
    if missing:
        log.error("--model-dir: not a directory: %s", ", ".join(missing))
        return 2
    if args.trust_remote_code:
        log.warning("--trust-remote-code: models may run the Python code they ship")
    # Imported here so `engined --help` answers without loading mlx.
    from engine_daemon.blas_check import warn_if_slow_blas
    from engine_daemon.response_store import ResponseStore
    from engine_daemon.scheduler import SchedulerConfig
    from engine_daemon.server import EndpointInUse, EngineServer

    warn_if_slow_blas()
    defaults = {"temperature": args.temperature if args.temperature is not None else 1.0}
    if args.top_p is not None:
        defaults["top_p"] = args.top_p
    budget = int(args.memory_budget * 2**30) if args.memory_budget else None
    if budget:
        import mlx.core as mx

        mx.set_memory_limit(budget)
        mx.set_cache_limit(budget // 4)
        log.info("memory budget %.1f GB: MLX memory limit set", args.memory_budget)
    config = SchedulerConfig(
        default_model=args.model,
        allow_download=args.allow_download,
        default_max_tokens=args.default_max_tokens,
        sampling_defaults=defaults,
        prefill_step_size=args.prefill_step_size,
        interleave_prefill_tokens=args.interleave_prefill_tokens,
        decode_concurrency=args.decode_concurrency,
        prompt_concurrency=args.prompt_concurrency,
        max_queued=args.max_queued,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes or (budget // 4 if budget else None),
        max_kv_size=args.max_kv_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        memory_budget_bytes=budget,
        model_dirs=roots,
        trust_remote_code=args.trust_remote_code,
    )
    if args.model:
        # The operator named it: fetch it now if it is not cached, before serving.
        from engine_daemon.model_store import ModelNotFound, resolve
        try:
            resolve(args.model, allow_download=True)
        except ModelNotFound as exc:
            log.error("cannot load --model: %s", exc)
            return 2
    server = EngineServer(args.endpoint, config, preload=args.model, peer_timeout=args.peer_timeout,
                          stall_timeout=args.stall_timeout, security=security,
                          responses=ResponseStore(args.responses_ttl, args.responses_max_bytes))
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    try:
        server.serve()
    except (EndpointInUse, InsecureEndpoint) as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
