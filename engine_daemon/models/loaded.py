"""A model in memory with what requests need from it: tokenizer, limits, default sampling."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn

from engine_daemon.models.names import ModelProfile
from engine_daemon.models.store import ModelRef


@dataclass
class LoadedModel:
    """A model with what requests need from it: tokenizer, limits and default sampling."""

    ref: ModelRef
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    context_window: int | None
    vocab_size: int = 0
    weights_bytes: int = 0
    kv_bytes_per_token: int = 0
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    loaded_at: float = field(default_factory=time.time)
    identity: str = ""  # the weights and config it was loaded from (`model_identity`): the prompt cache's key
    # Engine groups: "tp" | "pp" when this is one rank's shard, and the checkpoint's `weights_digest`
    # (the ranks compare it at start: every rank must load the same weights)
    group_mode: str | None = None
    weights_digest: str = ""
    # "text" (mlx-lm) or "vision" / "audio" (mlx-vlm: `vision` holds its processor and feature cache)
    kind: str = "text"
    vision: Any = None  # VisionSupport (engine_daemon.models.vision_support) for vision/audio models
    # Its name's settings (--models-config, --chat-template-file, --context-overflow): ModelProfile
    profile: ModelProfile = field(default_factory=ModelProfile)


# generation_config.json keys -> our sampling parameter names
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def read_generation_defaults(path: Path) -> dict[str, Any]:
    """Sampling defaults the model ships (used when a request omits a field)."""
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items() if theirs in config}


def kv_bytes_per_token(config: dict[str, Any], itemsize: int) -> int:
    """Keys + values of one token across all layers: what admission control budgets for."""
    config = {**config, **config.get("text_config", {})}
    layers = config.get("num_hidden_layers") or config.get("n_layer") or 0
    heads = config.get("num_attention_heads") or config.get("n_head") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads)
    return 2 * layers * kv_heads * head_dim * itemsize
