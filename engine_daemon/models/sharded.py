"""Loading one rank's shard of a text model: mlx-lm's `sharded_load` semantics, from a local directory.

Tensor parallelism (`tp`) uses the model's `shard(group)` (attention heads and MLP columns
split, each all_sum'd); pipeline parallelism (`pp`) uses `model.model.pipeline(group)`
(PipelineMixin: a contiguous run of layers per rank). The model is built lazily and only
the parameters this rank keeps are evaluated, so each rank reads and holds its shard
(plus what every rank must replicate: embeddings, final norm, head). Unlike
`mlx_lm.utils.sharded_load` this needs no `model.safetensors.index.json` (the engine
resolves models itself; a single-file checkpoint is read lazily just the same).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_model, load_tokenizer

log = logging.getLogger(__name__)


def can_shard(model: Any, mode: str) -> bool:
    if mode == "tp":
        return hasattr(model, "shard")
    return hasattr(model, "model") and hasattr(model.model, "pipeline")


def check_heads(config: dict[str, Any], ranks: int) -> None:
    """shard() divides the heads by the group size without checking: an uneven split would compute garbage."""
    text = config.get("text_config", config)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = text.get(key)
        if isinstance(heads, int) and heads % ranks:
            raise ValueError(f"tensor parallelism over {ranks} ranks needs {key} ({heads}) divisible by {ranks}")


def load_shard(path: Path, mode: str, group: Any, trust_remote_code: bool = False,
               tokenizer_config: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """(model holding this rank's shard, tokenizer, config); ValueError when the architecture cannot shard so."""
    model, config = load_model(path, lazy=True, strict=False, trust_remote_code=trust_remote_code)
    if not can_shard(model, mode):
        kind = "tensor parallelism (shard())" if mode == "tp" else "pipeline parallelism (PipelineMixin)"
        raise ValueError(f"{config.get('model_type')} models do not support {kind} in mlx-lm")
    if mode == "tp":
        check_heads(config, group.size())
        model.shard(group)
    else:
        model.model.pipeline(group)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id", None))
    # Every rank holds its shard before anyone serves (and a rank that failed to load is noticed here).
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    log.info("loaded rank %d/%d's %s shard of %s", group.rank(), group.size(), mode, path)
    return model, tokenizer, config
