"""`engined --group …` flags, what a group refuses at start (exit 2), and joining mx.distributed.

Kept apart from `engine_daemon.cli` so a single engine's start reads no group code; MLX is
imported only when a group is asked for (`engined --help` never loads it).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from engine_daemon.group.settings import MODES, GroupSettings, from_environment


def add_group_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--group", choices=MODES, default=env("MLX_ENGINE_GROUP") or None,
                        help="serve one model sharded over an engine group started by `mlx.launch` (or units "
                             "setting MLX_RANK and MLX_HOSTFILE): tp = tensor parallel (the model's shard()), "
                             "pp = pipeline parallel (PipelineMixin). Rank 0 serves front-ends; other ranks "
                             "follow its step plans. Needs --model; refuses --adapter-path, --draft-model, "
                             "--idle-unload, --kv-bits and --prompt-cache-dir. See deploy/groups.md. "
                             "[MLX_ENGINE_GROUP]")
    parser.add_argument("--group-backend", default=env("MLX_ENGINE_GROUP_BACKEND", "any"),
                        help="mx.distributed backend: any, ring (TCP/Thunderbolt), jaccl (RDMA over Thunderbolt "
                             "5), mpi. [MLX_ENGINE_GROUP_BACKEND] (default: %(default)s)")
    parser.add_argument("--group-control", default=env("MLX_ENGINE_GROUP_CONTROL") or None,
                        help="tcp://host:port of rank 0's control socket (wake-ups, heartbeats); default: rank "
                             "0's ring address from MLX_HOSTFILE with the port + 100. Private links only: it "
                             "has no authentication. [MLX_ENGINE_GROUP_CONTROL]")
    parser.add_argument("--group-step-timeout", type=float,
                        default=float(env("MLX_ENGINE_GROUP_STEP_TIMEOUT", "60")),
                        help="seconds one group step (plan + forward pass) may take before rank 0 declares a "
                             "rank hung, fails every stream and exits 75. [MLX_ENGINE_GROUP_STEP_TIMEOUT] "
                             "(default: %(default)s)")
    parser.add_argument("--group-checksum-every", type=int,
                        default=int(env("MLX_ENGINE_GROUP_CHECKSUM_EVERY", "16")),
                        help="steps between the ranks' comparison of generated-token checksums (a mismatch "
                             "fails the group loudly); 0 = never. [MLX_ENGINE_GROUP_CHECKSUM_EVERY] "
                             "(default: %(default)s)")
    parser.add_argument("--group-exit-delay", type=float, default=float(env("MLX_ENGINE_GROUP_EXIT_DELAY", "3")),
                        help="seconds a failed group's rank 0 keeps answering /health (naming the failed rank) "
                             "before it exits 75 for its supervisor to restart the group. "
                             "[MLX_ENGINE_GROUP_EXIT_DELAY] (default: %(default)s)")


def group_refusal(args: argparse.Namespace) -> str | None:
    """Why this configuration cannot run as a group (None: it can)."""
    if not args.model:
        return "--group needs --model: every rank loads its shard of that model at start"
    refused = {"--adapter-path": args.adapter_path, "--draft-model": args.draft_model,
               "--idle-unload": args.idle_unload, "--kv-bits": args.kv_bits,
               "--prompt-cache-dir": args.prompt_cache_dir}
    named = [flag for flag, value in refused.items() if value]
    if named:
        return f"--group cannot be combined with {', '.join(named)} (followers replay plans of the plain batch)"
    return None


def join_group(args: argparse.Namespace) -> tuple[GroupSettings, Any]:
    """Initialises mx.distributed and returns (this rank's settings, the group); ValueError on failure."""
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=True, backend=args.group_backend)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"--group: mx.distributed could not start ({exc}); run under mlx.launch or set "
                         "MLX_RANK and MLX_HOSTFILE") from None
    settings = from_environment(args.group, args.group_control, group.rank(), group.size(), args.group_backend,
                                args.group_step_timeout, args.group_checksum_every, args.group_exit_delay)
    return settings, group
