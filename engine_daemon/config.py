"""The engine's settings as the mlx thread and its schedulers see them (`engined` flags, parsed).

A leaf at run time: the model names type is only named for type checkers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_daemon.models.names import ModelNames

# Longest model or adapter name a request may send (a file name's limit; a longer one was a 500
# and a 1 MB log line).
MAX_NAME_BYTES = 255


@dataclass
class SchedulerConfig:
    default_model: str | None = None
    # Unknown model names reach this model instead of a 404 (--model-fallback): a name, or `loaded`.
    model_fallback: str | None = None
    allow_download: bool = False
    default_max_tokens: int = 4096
    # A max_tokens past the context window: `clamp` to what is left (agents' habit) or `error` (OpenAI's).
    max_tokens_overflow: str = "clamp"
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    prefill_step_size: int = 2048
    # Prompt tokens per step while other requests decode; 0 = paced by measurement (PrefillPacer).
    interleave_prefill_tokens: int = 0
    # Tokens per step (decode first, the rest prefill) while others decode; 0 = sized from step costs.
    step_token_budget: int = 0
    # The budget's target: a step with prefill costs at most this many decode steps (--max-gap-ratio).
    max_gap_ratio: float = 3.0
    # A lone newcomer's TTFT target over a full-speed prefill: its steps go under the gap target as far as this
    # leaves room (--max-ttft-ratio; `balanced_prefill_seconds`); 0: steps planned at the gap target.
    max_ttft_ratio: float = 1.5
    # A fused step running late cuts its chunk between two layers; the rest runs next step (`LayerCarry`).
    layer_cuts: bool = True
    # Full-speed prefill steps (nobody streams, or more prompts wait than streams run) last about this long, so
    # streams get a token and new requests start between them (--max-stall-seconds); 0: one chunk per prompt a step.
    max_stall_seconds: float = 1.0
    # A request that wakes an idle engine waits until this long passes with no other arrival (at most three
    # times it), so requests sent together are prefilled together (--coalesce-ms; `worth_coalescing`).
    coalesce_seconds: float = 0.008
    # Run a lone prompt's chunk in the decode step's forward pass (StallFreeBatchGenerator).
    fused_prefill: bool = True
    decode_concurrency: int = 32
    # Stop strings per request and characters per stop string (--max-stop-strings, --max-stop-length).
    max_stop_strings: int = 16
    max_stop_length: int = 1024
    # Most decode slots one client may hold (--max-slots-per-key); 0: no ceiling.
    max_slots_per_key: int = 0
    # A client holding 2+ more decode slots than a waiting one pauses its newest request (--fair-preemption).
    fair_preemption: bool = True
    prompt_concurrency: int = 8
    max_queued: int = 256
    # Seconds of uploaded audio (16 kHz float32) queued auxiliary jobs may hold together (--max-queued-audio-seconds).
    max_queued_audio_seconds: float = 3600.0
    prompt_cache_size: int = 10
    prompt_cache_bytes: int | None = None
    # --prompt-cache-dir: the disk tier of the prefix cache (DiskTier) and its byte cap.
    prompt_cache_dir: str | None = None
    prompt_cache_disk_bytes: int = 10 << 30
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    memory_budget_bytes: int | None = None
    # Directories whose model subdirectories requests may name (absolute, resolved: `model_roots`).
    model_dirs: tuple[Path, ...] = ()
    # Let mlx_lm run Python files shipped with a model (never by default: models come from requests too).
    trust_remote_code: bool = False
    # The operator's model names and per-model settings (`ModelNames`); None: no names.
    names: ModelNames | None = None
    # Seconds without any request after which the mlx thread unloads the model (--idle-unload); None: never.
    idle_unload: float | None = None
    # LoRA adapters (`AdapterManager`): --adapter-path for --model's requests, LRU of loaded adapters.
    adapter_path: str | None = None
    adapter_cache_size: int = 8
    # Speculative decoding of lone requests (`SpeculativeDecoder`): --draft-model, --num-draft-tokens.
    draft_model: str | None = None
    num_draft_tokens: int = 3
    # While a request for another model waits, requests for the loaded one keep joining the batch for up
    # to this many seconds (then the batch drains and the model switches): fewer loads when clients
    # alternate models, bounded extra wait for the other model. 0: strict arrival order.
    model_switch_delay: float = 2.0
    # Auxiliary slots (`AuxiliarySlots`): kind -> model preloaded at start (--embedding-model, ...), and the
    # tokens of auxiliary work run between two generation steps (--aux-step-tokens).
    auxiliary_models: dict[str, str] = field(default_factory=dict)
    aux_step_tokens: int = 0  # 0: sized from measured costs (`AuxiliaryQueue.slice_budget`)
