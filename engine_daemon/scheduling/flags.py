"""The `engined` flags of prefill scheduling (each with its environment variable).

Kept beside the scheduler rather than in `engine_daemon.cli`: how prompts share steps
with running streams (`PrefillPacer`, `StallFreeBatchGenerator`) is one concern, and
its knobs read together. The CLI adds them to its parser and passes what they say on.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_scheduling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-step-size", type=int, default=int(os.environ.get("PREFILL_STEP_SIZE", "2048")),
                        help="prompt tokens processed per model call. [PREFILL_STEP_SIZE] (default: %(default)s)")
    parser.add_argument("--interleave-prefill-tokens", type=int,
                        default=int(os.environ.get("MLX_ENGINE_INTERLEAVE_PREFILL_TOKENS", "0")),
                        help="prompt tokens prefilled per step while other requests decode, so a long prompt "
                             "does not stall running streams; 0 sizes the chunk from measured step times so a "
                             "step with prefill costs about one extra decode step. "
                             "[MLX_ENGINE_INTERLEAVE_PREFILL_TOKENS] (default: %(default)s)")
    parser.add_argument("--step-token-budget", type=int,
                        default=int(os.environ.get("MLX_ENGINE_STEP_TOKEN_BUDGET", "0")),
                        help="tokens one step may process while requests decode: one per running stream first, "
                             "the rest for prompt chunks (stall-free batching); 0 sizes it from measured step "
                             "costs to meet --max-gap-ratio. [MLX_ENGINE_STEP_TOKEN_BUDGET] (default: %(default)s)")
    parser.add_argument("--max-gap-ratio", type=float,
                        default=float(os.environ.get("MLX_ENGINE_MAX_GAP_RATIO", "3.0")),
                        help="with an automatic token budget, a step that also prefills costs at most this many "
                             "decode steps, so running streams' inter-token gaps stay within it while a prompt "
                             "arrives (steps are timed as clients see them: with the engine's work between two; "
                             "steps are planned below it by how much dearer than planned this machine's steps "
                             "come out, its 90th percentile). "
                             "[MLX_ENGINE_MAX_GAP_RATIO] (default: %(default)s)")
    parser.add_argument("--max-ttft-ratio", type=float,
                        default=float(os.environ.get("MLX_ENGINE_MAX_TTFT_RATIO", "1.5")),
                        help="with an automatic token budget, a prompt prefilled beside running streams should get "
                             "its first token within this many times what a full-speed prefill takes; where that "
                             "leaves room, its steps are planned further under --max-gap-ratio (both targets equally "
                             "far off), and where it does not, --max-gap-ratio holds. 0 plans at --max-gap-ratio. "
                             "[MLX_ENGINE_MAX_TTFT_RATIO] (default: %(default)s)")
    parser.add_argument("--fused-prefill", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("MLX_ENGINE_FUSED_PREFILL", "1") != "0",
                        help="run a lone prompt's chunk inside the decode step's forward pass (llama, qwen2, "
                             "qwen3, mistral), so streams and the newcomer share one read of the weights. "
                             "[MLX_ENGINE_FUSED_PREFILL=0 turns it off] (default: on)")
    parser.add_argument("--layer-cuts", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("MLX_ENGINE_LAYER_CUTS", "1") != "0",
                        help="with an automatic token budget on the CPU, a fused step whose prefill runs late lets "
                             "its chunk leave the pass after the layer it is in, so the streams' step ends within "
                             "--max-gap-ratio; the rest of the chunk's layers run in the next step, nothing lost. "
                             "[MLX_ENGINE_LAYER_CUTS=0 turns it off] (default: on)")
    parser.add_argument("--prompt-concurrency", type=int,
                        default=int(os.environ.get("MLX_ENGINE_PROMPT_CONCURRENCY", "8")),
                        help="most prompts prefilled together. [MLX_ENGINE_PROMPT_CONCURRENCY] (default: %(default)s)")
    parser.add_argument("--max-stall-seconds", type=float,
                        default=float(os.environ.get("MLX_ENGINE_MAX_STALL_SECONDS", "1.0")),
                        help="prompts prefilled at full speed (nobody streams, or more prompts wait than streams "
                             "run) go in steps of about this long, sized from the measured cost per prompt token, "
                             "so running streams get a token and new requests start between steps; 0: one step "
                             "per --prefill-step-size chunk. [MLX_ENGINE_MAX_STALL_SECONDS] (default: %(default)s)")
    parser.add_argument("--coalesce-ms", type=float, default=float(os.environ.get("MLX_ENGINE_COALESCE_MS", "8")),
                        help="when a request wakes an idle engine and its prefill will take at least 20 times "
                             "this, wait until this many ms pass with no other request (at most 3 times it), so "
                             "requests sent together are prefilled together instead of the first alone; 0 turns "
                             "it off. [MLX_ENGINE_COALESCE_MS] (default: %(default)s)")


def scheduling_config(args: argparse.Namespace) -> dict[str, Any]:
    """The `SchedulerConfig` fields these flags set."""
    return {"prefill_step_size": args.prefill_step_size,
            "interleave_prefill_tokens": args.interleave_prefill_tokens,
            "step_token_budget": args.step_token_budget,
            "max_gap_ratio": args.max_gap_ratio,
            "max_ttft_ratio": max(0.0, args.max_ttft_ratio),
            "layer_cuts": args.layer_cuts,
            "max_stall_seconds": max(0.0, args.max_stall_seconds),
            "coalesce_seconds": max(0.0, args.coalesce_ms) / 1000,
            "fused_prefill": args.fused_prefill,
            "prompt_concurrency": args.prompt_concurrency}
