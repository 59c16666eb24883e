"""`engined`: the daemon that owns the MLX model and serves front-ends over ZeroMQ."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from engine_daemon.auxiliary.flags import add_auxiliary_flags, auxiliary_config
from engine_daemon.calls.drain import install_signals as install_drain_signals
from engine_daemon.calls.response_store import ResponseStore
from engine_daemon.config import SchedulerConfig
from engine_daemon.group.options import add_group_arguments, group_refusal, join_group
from engine_daemon.lora.registry import is_adapter_dir
from engine_daemon.models.names import ModelNames, ModelsConfigError
from engine_daemon.models.store import ModelNotFound, model_roots, resolve, set_operator_names
from engine_daemon.prefix_cache.directory import unusable
from engine_daemon.request import template_kwargs
from engine_daemon.scheduling.flags import add_scheduling_flags, scheduling_config
from engine_daemon.transport.flags import add_transport_flags, parse_size
from engine_daemon.transport.security import InsecureEndpoint, SocketSecurity, check_endpoint, keygen_main
from protocol.endpoints import ENDPOINT_ENV, default_endpoint


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def _path_or_none(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def _first_env(*names: str) -> str | None:
    """The first of several equivalent environment variables that is set (mlx_vlm.server's names included)."""
    return next((os.environ[name] for name in names if os.environ.get(name)), None)


# --model's environment equivalents, in order of precedence (PRELOAD_* as mlx_lm/mlx_vlm servers name them).
MODEL_ENV = ("MLX_ENGINE_MODEL", "PRELOAD_MODEL", "MLX_VLM_PRELOAD_MODEL")
# --adapter-path's, likewise.
ADAPTER_ENV = ("MLX_ENGINE_ADAPTER_PATH", "PRELOAD_ADAPTER", "MLX_VLM_PRELOAD_ADAPTER")


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None


def _numpy_path_flag(parser: argparse.ArgumentParser, flag: str, env: str, what: str) -> None:
    """A `numpy`/`mlx` choice for one of the CPU's NumPy paths (`prefill_attention`, `decode_attention`,
    `prefill_swiglu`)."""
    parser.add_argument(flag, choices=["numpy", "mlx"], default=os.environ.get(env, "numpy"),
                        help=f"{what} Results equal MLX's to float rounding, not bitwise; 'mlx' keeps MLX's; "
                             f"no effect on a GPU. [{env}] (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engined",
        description="mlx-engined daemon: loads an MLX model and streams generations to front-ends "
                    "over ZeroMQ. Every flag has an environment variable equivalent (in brackets).",
        epilog="`engined keygen DIR` creates CURVE certificates for tcp:// across hosts "
               "(see `engined keygen --help`).",
    )
    parser.add_argument("--model", default=_first_env(*MODEL_ENV),
                        help="model to load at start: a Hugging Face repo id (local cache first, then "
                             "downloaded), a local directory, or a --models-config alias. Optional: without it "
                             "the first request's 'model' loads one. [MLX_ENGINE_MODEL, or PRELOAD_MODEL / "
                             "MLX_VLM_PRELOAD_MODEL]")
    parser.add_argument("--served-model-name", default=os.environ.get("MLX_ENGINE_SERVED_MODEL_NAME"),
                        help="the name the --model is known by in /v1/models and in responses' 'model' field; "
                             "requests may use it, its own id or its path. [MLX_ENGINE_SERVED_MODEL_NAME]")
    parser.add_argument("--model-fallback", default=os.environ.get("MLX_ENGINE_MODEL_FALLBACK") or None,
                        metavar="NAME|loaded",
                        help="a request naming a model the engine does not know (an agent's hard-coded "
                             "'claude-sonnet-…' or 'gpt-…') is served by this model instead of a 404: 'loaded' "
                             "for whatever model is loaded (else --model), or a model name. Off by default. "
                             "[MLX_ENGINE_MODEL_FALLBACK]")
    parser.add_argument("--models-config", type=Path, default=_path_or_none("MLX_ENGINE_MODELS_CONFIG"),
                        help="YAML file of model aliases: per entry 'alias', 'path' or 'repo', and per-model "
                             "defaults (temperature, top_p, top_k, min_p, ..., max_tokens, context_length, "
                             "chat_template file, tool_parser, reasoning_parser, context_overflow); see README. "
                             "[MLX_ENGINE_MODELS_CONFIG]")
    parser.add_argument("--chat-template-file", type=Path, default=_path_or_none("MLX_ENGINE_CHAT_TEMPLATE_FILE"),
                        help="Jinja chat template used instead of every model's own (a models-config entry may "
                             "name another, or 'model' for the model's own). [MLX_ENGINE_CHAT_TEMPLATE_FILE]")
    parser.add_argument("--context-overflow", choices=("error", "truncate", "summarize"),
                        default=os.environ.get("MLX_ENGINE_CONTEXT_OVERFLOW", "error"),
                        help="a chat longer than the context window: 'error' answers 400 context_length_exceeded; "
                             "'truncate' drops the oldest non-system turns until it fits; 'summarize' keeps the "
                             "system messages and the last 6 messages and has the model summarise the rest. "
                             "Reported in the X-Context-Overflow header and usage.context_overflow. "
                             "[MLX_ENGINE_CONTEXT_OVERFLOW] (default: %(default)s)")
    parser.add_argument("--max-tokens-overflow", choices=("clamp", "error"),
                        default=os.environ.get("MLX_ENGINE_MAX_TOKENS_OVERFLOW", "clamp"),
                        help="a request whose max_tokens does not fit in the context window after its prompt: "
                             "'clamp' lowers it to what the window has left (agents such as Claude Code ask for "
                             "128000 whatever the model), 'error' answers 400 context_length_exceeded as OpenAI "
                             "does. A prompt that alone fills the window follows --context-overflow. "
                             "[MLX_ENGINE_MAX_TOKENS_OVERFLOW] (default: %(default)s)")
    parser.add_argument("--idle-unload", type=float, default=_env_float("MLX_ENGINE_IDLE_UNLOAD"), metavar="SECONDS",
                        help="unload the model after this many seconds without requests (frees its memory; the "
                             "next request loads it again). Default: never. [MLX_ENGINE_IDLE_UNLOAD]")
    parser.add_argument("--model-switch-delay", type=float, metavar="SECONDS",
                        default=float(os.environ.get("MLX_ENGINE_MODEL_SWITCH_DELAY") or 2.0),
                        help="while a request for another model waits, requests for the loaded model keep joining "
                             "its batch for up to this long before the batch drains and the model switches: fewer "
                             "reloads when clients alternate models, at most this much extra wait for the other "
                             "model. 0: strict arrival order. [MLX_ENGINE_MODEL_SWITCH_DELAY] (default: "
                             "%(default)s)")
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
    add_scheduling_flags(parser)  # --prefill-step-size, --max-gap-ratio, --max-stall-seconds, ...
    parser.add_argument("--allow-request-chat-template", action="store_true",
                        default=os.environ.get("MLX_ENGINE_ALLOW_REQUEST_CHAT_TEMPLATE") == "1",
                        help="let requests send their own chat template (chat_template_kwargs.chat_template), "
                             "rendered in Jinja's sandbox under a line, time and size budget; refused with a 400 "
                             "otherwise. [MLX_ENGINE_ALLOW_REQUEST_CHAT_TEMPLATE=1]")
    parser.add_argument("--max-stop-strings", type=int,
                        default=int(os.environ.get("MLX_ENGINE_MAX_STOP_STRINGS", "16")),
                        help="most stop strings in one request (400 beyond). [MLX_ENGINE_MAX_STOP_STRINGS] "
                             "(default: %(default)s)")
    parser.add_argument("--max-stop-length", type=int,
                        default=int(os.environ.get("MLX_ENGINE_MAX_STOP_LENGTH", "1024")),
                        help="most characters in one stop string (400 beyond); matching is linear in the text. "
                             "[MLX_ENGINE_MAX_STOP_LENGTH] (default: %(default)s)")
    parser.add_argument("--max-slots-per-key", type=int,
                        default=int(os.environ.get("MLX_ENGINE_MAX_SLOTS_PER_KEY", "0")),
                        help="most decode slots one client (API key, else `user`) may hold at once; 0: no ceiling. "
                             "Slots are always handed out fewest-running-client first. "
                             "[MLX_ENGINE_MAX_SLOTS_PER_KEY] (default: %(default)s)")
    parser.add_argument("--fair-preemption", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("MLX_ENGINE_FAIR_PREEMPTION", "1").lower() not in ("0", "false", "no"),
                        help="with every decode slot taken and a waiting client holding 2+ fewer than the top one, "
                             "pause that one's newest request and resume it from its KV later, output unchanged. "
                             "[MLX_ENGINE_FAIR_PREEMPTION] (default: on)")
    parser.add_argument("--decode-concurrency", type=int,
                        default=int(os.environ.get("MLX_ENGINE_DECODE_CONCURRENCY", "32")),
                        help="most requests decoding in one batch. [MLX_ENGINE_DECODE_CONCURRENCY] "
                             "(default: %(default)s)")
    parser.add_argument("--cpu-parallel-ops", type=int,
                        default=int(os.environ.get("MLX_ENGINE_CPU_PARALLEL_OPS", str(min(os.cpu_count() or 1, 8)))),
                        help="on the CPU, split large element-wise ops (SwiGLU, attention softmax) over this many "
                             "MLX streams so all cores work during prefill; outputs are bitwise unchanged. "
                             "1 turns it off; no effect on a GPU. [MLX_ENGINE_CPU_PARALLEL_OPS] "
                             "(default: the CPU count, at most 8: %(default)s)")
    _numpy_path_flag(parser, "--cpu-prefill-attention", "MLX_ENGINE_CPU_PREFILL_ATTENTION",
                     "on the CPU, compute prompts' attention with the softmax's exp in NumPy (SIMD), which MLX's "
                     "x86 build runs one element at a time: ~3-4x faster attention, ~25%% faster prefill of a "
                     "1,500-token prompt. A step carrying a prompt chunk computes its decode rows this way too; plain "
                     "decode steps follow --cpu-decode-attention.")
    _numpy_path_flag(parser, "--cpu-decode-attention", "MLX_ENGINE_CPU_DECODE_ATTENTION",
                     "on the CPU, compute decode steps' attention the same NumPy way once a layer's scores number "
                     "16,384 (sequences x query heads x tokens of context): a step of 5 sequences at 2,000 tokens "
                     "~1.6x faster on the ~85M bench model; below that MLX's, evaluated asynchronously.")
    _numpy_path_flag(parser, "--cpu-prefill-swiglu", "MLX_ENGINE_CPU_PREFILL_SWIGLU",
                     "on the CPU, compute prompts' SwiGLU gate (silu(gate) * up) in NumPy (SIMD exp): ~8x faster "
                     "than MLX's x86 kernel, a prefill ~10%% faster and a step carrying a prompt chunk beside "
                     "running streams ~13%% cheaper. Plain decode steps always use MLX's.")
    parser.add_argument("--max-queued", type=int, default=int(os.environ.get("MLX_ENGINE_MAX_QUEUED", "256")),
                        help="requests waiting to start before new ones get 429; also each client's requests waiting "
                             "to be rendered. [MLX_ENGINE_MAX_QUEUED] (default: %(default)s)")
    parser.add_argument("--max-queued-audio-seconds", type=float,
                        default=float(os.environ.get("MLX_ENGINE_MAX_QUEUED_AUDIO_SECONDS", "3600")),
                        help="seconds of uploaded audio that waiting and running transcriptions may hold together "
                             "(16 kHz float32: 3600 s is 230 MB); past it new ones get 429. "
                             "[MLX_ENGINE_MAX_QUEUED_AUDIO_SECONDS] (default: %(default)s)")
    parser.add_argument("--prompt-cache-size", type=int,
                        default=int(os.environ.get("MLX_ENGINE_PROMPT_CACHE_SIZE", "10")),
                        help="most prefix-cache entries (LRU). [MLX_ENGINE_PROMPT_CACHE_SIZE] (default: %(default)s)")
    parser.add_argument("--prompt-cache-bytes", type=parse_size,
                        default=parse_size(os.environ.get("MLX_ENGINE_PROMPT_CACHE_BYTES")),
                        help="byte cap of the prefix cache, e.g. 2GB or 512MB (default: a quarter of "
                             "--memory-budget, else unbounded). [MLX_ENGINE_PROMPT_CACHE_BYTES]")
    parser.add_argument("--prompt-cache-dir", default=os.environ.get("MLX_ENGINE_PROMPT_CACHE_DIR") or None,
                        metavar="DIR",
                        help="a disk tier for the prefix cache (vision models' too, images included): prefixes "
                             "evicted from memory, and all on a model switch or a clean stop, are written here "
                             "(safetensors, checked by hash) and loaded after a switch back or a restart when reading "
                             "beats prefilling. Engines may share it; made if missing, refused at start (exit 2) if "
                             "not writable. Default: off. [MLX_ENGINE_PROMPT_CACHE_DIR]")
    parser.add_argument("--prompt-cache-disk-bytes", type=parse_size,
                        default=parse_size(os.environ.get("MLX_ENGINE_PROMPT_CACHE_DISK_BYTES")) or 10 << 30,
                        help="byte cap of --prompt-cache-dir (text and vision entries together), e.g. 20GB; least "
                             "recently used files go first (default: 10 GiB). [MLX_ENGINE_PROMPT_CACHE_DISK_BYTES]")
    parser.add_argument("--max-kv-size", type=int, default=_int_or_none(os.environ.get("MAX_KV_SIZE")),
                        help="rotating KV cache of this many tokens per request (default: off). [MAX_KV_SIZE]")
    parser.add_argument("--kv-bits", type=int, default=_int_or_none(os.environ.get("KV_BITS")),
                        help="quantize the KV cache to this many bits (default: off). mlx-lm cannot batch a "
                             "quantized cache: requests then run one at a time, as the log and /stats say. [KV_BITS]")
    parser.add_argument("--kv-group-size", type=int, default=int(os.environ.get("KV_GROUP_SIZE", "64")),
                        help="group size of KV quantization. [KV_GROUP_SIZE] (default: %(default)s)")
    parser.add_argument("--quantized-kv-start", type=int, default=int(os.environ.get("QUANTIZED_KV_START", "5000")),
                        help="tokens after which the KV cache is quantized. [QUANTIZED_KV_START] "
                             "(default: %(default)s)")
    parser.add_argument("--memory-budget", type=float, default=_env_float("MLX_ENGINE_MEMORY_BUDGET"),
                        help="GB the engine may use (weights + KV + caches). Requests whose KV would not fit get "
                             "400 memory_budget_exceeded before generating, and MLX's memory limit is set to it. "
                             "[MLX_ENGINE_MEMORY_BUDGET]")
    parser.add_argument("--temperature", type=float, default=_env_float("MLX_ENGINE_TEMPERATURE"),
                        help="default temperature when neither the request nor the model's "
                             "generation_config.json sets one (then 1.0). [MLX_ENGINE_TEMPERATURE]")
    parser.add_argument("--top-p", type=float, default=_env_float("MLX_ENGINE_TOP_P"),
                        help="default top_p, as --temperature. [MLX_ENGINE_TOP_P]")
    add_transport_flags(parser)  # --peer-timeout, --peer-max-queued, --stall-timeout
    parser.add_argument("--responses-ttl", type=float,
                        default=float(os.environ.get("MLX_ENGINE_RESPONSES_TTL", "3600")),
                        help="seconds a stored Responses API response stays resumable (previous_response_id) "
                             "and retrievable; the store is in memory and an engine restart loses it. "
                             "[MLX_ENGINE_RESPONSES_TTL] (default: %(default)s)")
    parser.add_argument("--responses-max-bytes", type=parse_size,
                        default=parse_size(os.environ.get("MLX_ENGINE_RESPONSES_MAX_BYTES") or "64MB"),
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
    parser.add_argument("--adapter-path", default=_first_env(*ADAPTER_ENV),
                        help="LoRA adapter directory (mlx-lm format: adapter_config.json + adapters.safetensors) "
                             "applied to --model's requests that name no adapter; needs --model. Requests may "
                             "name another adapter ('adapter_path': a registered name or a directory under "
                             "--model-dir); switching never reloads the model. [MLX_ENGINE_ADAPTER_PATH, or "
                             "PRELOAD_ADAPTER / MLX_VLM_PRELOAD_ADAPTER]")
    parser.add_argument("--adapter-cache-size", type=int,
                        default=int(os.environ.get("MLX_ENGINE_ADAPTER_CACHE_SIZE", "8")),
                        help="most LoRA adapters kept loaded in memory (LRU). [MLX_ENGINE_ADAPTER_CACHE_SIZE] "
                             "(default: %(default)s)")
    parser.add_argument("--draft-model", default=os.environ.get("MLX_ENGINE_DRAFT_MODEL"),
                        help="small model with the same tokenizer that drafts tokens for speculative decoding of "
                             "requests running alone (greedy output unchanged; others arriving move it into the "
                             "batch). Refused at start if its vocabulary differs from --model's. "
                             "[MLX_ENGINE_DRAFT_MODEL]")
    parser.add_argument("--num-draft-tokens", type=int,
                        default=int(os.environ.get("MLX_ENGINE_NUM_DRAFT_TOKENS", "3")),
                        help="tokens the draft model proposes per verification step. [MLX_ENGINE_NUM_DRAFT_TOKENS] "
                             "(default: %(default)s)")
    add_auxiliary_flags(parser)  # --embedding-model, --aux-step-tokens, ...
    parser.add_argument("--log-level", default=os.environ.get("MLX_ENGINE_LOG_LEVEL", "INFO"),
                        help="logging level. [MLX_ENGINE_LOG_LEVEL] (default: %(default)s)")
    add_group_arguments(parser)
    return parser


# Exit status when the mlx thread died (EX_SOFTWARE): the supervisor restarts the engine.
MLX_THREAD_DIED = 70


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        return keygen_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s engined[%(process)d] %(name)s: %(message)s")
    log = logging.getLogger("engined")
    # Refused before mlx loads or a model downloads: a misconfigured socket is an operator error.
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
    try:
        names = ModelNames.from_options(models_config=args.models_config, model=args.model,
                                        served_model_name=args.served_model_name,
                                        chat_template_file=args.chat_template_file,
                                        context_overflow=args.context_overflow)
    except ModelsConfigError as exc:
        log.error("%s", exc)
        return 2
    set_operator_names(names.names())
    template_kwargs.configure(args.allow_request_chat_template)
    if args.idle_unload is not None and args.idle_unload <= 0:
        log.error("--idle-unload must be a positive number of seconds")
        return 2
    if args.prompt_cache_dir and (problem := unusable(args.prompt_cache_dir)):
        log.error("--prompt-cache-dir %s: %s", args.prompt_cache_dir, problem)
        return 2
    # Lazy on purpose: these load MLX, which `engined --help`, `engined keygen` and a refused
    # configuration never need (the only imports of our own modules inside a function).
    from engine_daemon.cpu.blas_check import warn_if_slow_blas
    from engine_daemon.transport.server import EndpointInUse, EngineServer

    warn_if_slow_blas()
    from engine_daemon.cpu import decode_attention, prefill_attention, prefill_swiglu
    from engine_daemon.cpu import parallel_ops as cpu_parallel
    cpu_parallel.configure(args.cpu_parallel_ops)
    prefill_attention.configure(args.cpu_prefill_attention == "numpy")
    decode_attention.configure(args.cpu_decode_attention == "numpy")
    prefill_swiglu.configure(args.cpu_prefill_swiglu == "numpy")
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
        model_fallback=args.model_fallback,
        allow_download=args.allow_download,
        default_max_tokens=args.default_max_tokens,
        max_tokens_overflow=args.max_tokens_overflow,
        sampling_defaults=defaults,
        decode_concurrency=args.decode_concurrency,
        max_slots_per_key=max(0, args.max_slots_per_key), fair_preemption=args.fair_preemption,
        max_stop_strings=max(1, args.max_stop_strings),
        max_stop_length=max(1, args.max_stop_length),
        max_queued=args.max_queued, max_queued_audio_seconds=args.max_queued_audio_seconds,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes or (budget // 4 if budget else None),
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
        max_kv_size=args.max_kv_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        memory_budget_bytes=budget,
        model_dirs=roots,
        trust_remote_code=args.trust_remote_code,
        names=names,
        idle_unload=args.idle_unload,
        model_switch_delay=max(0.0, args.model_switch_delay),
        adapter_path=args.adapter_path,
        adapter_cache_size=args.adapter_cache_size,
        draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
        **auxiliary_config(args),
        **scheduling_config(args),
    )
    if args.model:
        # The operator named it: fetch it now if it is not cached, before serving.
        try:
            resolve(names.source_of(args.model), allow_download=True)
        except ModelNotFound as exc:
            log.error("cannot load --model: %s", exc)
            return 2
    failed = _check_adapter_and_draft(args, names.source_of(args.model) if args.model else None, log)
    if failed:
        return failed
    group = None
    if args.group:
        try:
            refusal = group_refusal(args)
            if refusal:
                raise ValueError(refusal)
            group = join_group(args)
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        if not group[0].leader:  # a follower: no front-end socket, it replays rank 0's plans
            from engine_daemon.scheduling.follower import FollowerLoop

            follower = FollowerLoop(group[0], group[1], config)
            signal.signal(signal.SIGTERM, lambda *_: follower.request_stop())
            return follower.run()
    server = EngineServer(args.endpoint, config, preload=args.model, peer_timeout=args.peer_timeout,
                          stall_timeout=args.stall_timeout, security=security,
                          responses=ResponseStore(args.responses_ttl, args.responses_max_bytes), group=group,
                          peer_max_queued=args.peer_max_queued)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    install_drain_signals(server)  # SIGUSR1 / SIGUSR2: drain / undrain (rolling restarts)
    try:
        server.serve()
    except (EndpointInUse, InsecureEndpoint) as exc:
        log.error("%s", exc)
        return 1
    return MLX_THREAD_DIED if server.failed else 0


def _check_adapter_and_draft(args: argparse.Namespace, model_source: str | None, log: logging.Logger) -> int:
    """--adapter-path and --draft-model refused at start (exit 2) rather than failing every request later."""
    if args.adapter_path:
        if not args.model:
            log.error("--adapter-path needs --model (the adapter belongs to that model)")
            return 2
        if not is_adapter_dir(Path(args.adapter_path).expanduser()):
            log.error("--adapter-path %s: not an adapter directory (adapter_config.json + adapters.safetensors)",
                      args.adapter_path)
            return 2
    if args.adapter_cache_size < 1:
        log.error("--adapter-cache-size must be at least 1")
        return 2
    if args.draft_model:
        from engine_daemon.generation.speculative import IncompatibleDraft, check_draft_paths

        if args.num_draft_tokens < 1:
            log.error("--num-draft-tokens must be at least 1")
            return 2
        try:
            draft = resolve(args.draft_model, allow_download=True)
            if model_source:
                check_draft_paths(resolve(model_source, allow_download=True).path, draft.path)
        except (ModelNotFound, IncompatibleDraft) as exc:
            log.error("cannot use --draft-model: %s", exc)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
