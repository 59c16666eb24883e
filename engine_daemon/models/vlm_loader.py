"""Vision (and audio) models through mlx-vlm: `mlx_vlm.load` of the model and its processor.

A model whose config.json has a vision (or audio) tower is loaded here; text models keep
the mlx-lm path (`ModelManager`). mlx-vlm itself is imported only when such a model loads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from engine_daemon.models.loaded import LoadedModel, kv_bytes_per_token, read_generation_defaults
from engine_daemon.models.store import ModelRef, context_window_of_config, model_kind
from engine_daemon.models.vision_support import FEATURE_ENCODERS, VisionSupport

log = logging.getLogger(__name__)


class _ProcessorKwargsNoise(logging.Filter):
    """Drops transformers' per-request warning about the template kwargs mlx-vlm passes (harmless)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "have to be in `processor_kwargs`" not in record.getMessage()


_NOISE_FILTER = _ProcessorKwargsNoise()


def _accepts_audio(config: dict[str, Any], model: Any) -> bool:
    return bool(config.get("audio_config")) or any(
        getattr(model, name, None) is not None for name in ("audio_tower", "audio_model", "audio_encoder"))


def load_vision_model(ref: ModelRef, trust_remote_code: bool = False) -> LoadedModel:
    """Loads `ref` with `mlx_vlm.load` (model + processor) as a LoadedModel of kind vision/audio.

    `LoadedModel.tokenizer` is mlx-lm's TokenizerWrapper over the same tokenizer files, so
    everything the text path does with a tokenizer (stop/EOS handling, streaming
    detokenizer, output parsing, /tokenize) works unchanged for vision models.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm import load as mlx_vlm_load

    config = json.loads((ref.path / "config.json").read_text())
    kind = model_kind(ref.path)
    logging.getLogger("transformers.processing_utils").addFilter(_NOISE_FILTER)  # idempotent
    model, processor = mlx_vlm_load(str(ref.path), trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(Path(ref.path), eos_token_ids=config.get("eos_token_id"))
    # Text exactly as mlx-vlm writes it (mlx_vlm.generate / mlx_vlm.server): its streaming
    # detokenizer keeps the first token's leading space, which mlx-lm's trims.
    detokenizer = getattr(processor, "detokenizer", None)
    if detokenizer is not None and hasattr(tokenizer, "_detokenizer"):
        tokenizer._detokenizer = detokenizer
    parameters = [p for _, p in tree_flatten(model.parameters())]
    itemsize = max((p.dtype.size for p in parameters if mx.issubdtype(p.dtype, mx.floating)), default=2)
    text_config = {**config, **(config.get("text_config") or {})}
    support = VisionSupport(processor=processor, config=model.config, model_type=config.get("model_type", ""),
                            accepts_images=bool(config.get("vision_config")),
                            accepts_audio=_accepts_audio(config, model))
    if support.model_type not in FEATURE_ENCODERS:
        log.info("model type %s: no per-image feature cache (images are encoded on every request)",
                 support.model_type)
    return LoadedModel(
        ref=ref, model=model, tokenizer=tokenizer, context_window=context_window_of_config(config),
        vocab_size=int(text_config.get("vocab_size") or 0),
        weights_bytes=sum(p.nbytes for p in parameters),
        kv_bytes_per_token=kv_bytes_per_token(config, itemsize),
        generation_defaults=read_generation_defaults(ref.path), kind=kind, vision=support)
