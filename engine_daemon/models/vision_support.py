"""What a loaded vision/audio model carries beyond a text model: processor, capabilities, feature cache.

The projected image features are cached by content hash (`FeatureCache`): the same image
in the next turn of a conversation is not run through the vision tower again. Runs on
the mlx thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

# Images whose projected features stay cached (per loaded model; freed with it).
FEATURE_CACHE_SIZE = 64


class FeatureCache:
    """LRU of projected image features keyed by content hash (+ resize), for one loaded model."""

    def __init__(self, size: int = FEATURE_CACHE_SIZE):
        self.size = size
        self._entries: OrderedDict[str, mx.array] = OrderedDict()
        self.hits = 0
        self.encoded = 0

    def get(self, key: str) -> mx.array | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return value

    def put(self, key: str, value: mx.array) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        self.encoded += 1
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


# Per-image vision encoders, by model_type: (model, pixel rows of one image, its grid) -> features.
# An architecture listed here gets per-image feature caching (mlx-vlm's `cached_image_features`
# input); any other still works, its images are simply encoded on every request.
def _qwen_vl_encoder(model: Any, pixel_values: mx.array, grid_thw: mx.array) -> mx.array:
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    return model.vision_tower(pixel_values.astype(dtype), grid_thw, output_hidden_states=False)


FEATURE_ENCODERS: dict[str, Callable[[Any, mx.array, mx.array], mx.array]] = {
    "qwen2_vl": _qwen_vl_encoder,
    "qwen2_5_vl": _qwen_vl_encoder,
}


@dataclass
class VisionSupport:
    """What a vision model needs beyond a text model: its processor, capabilities, feature cache."""

    processor: Any
    config: Any  # the mlx-vlm model config object
    model_type: str
    accepts_images: bool
    accepts_audio: bool
    features: FeatureCache = field(default_factory=FeatureCache)

    def stats(self) -> dict[str, int]:
        return {"vision_images_encoded": self.features.encoded, "vision_feature_cache_hits": self.features.hits,
                "vision_feature_cache_entries": len(self.features)}


def cache_stats(loaded: Any) -> dict[str, int]:
    support = loaded.vision if loaded is not None else None
    return support.stats() if support is not None else {}
