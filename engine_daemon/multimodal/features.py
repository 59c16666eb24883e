"""Projected image features of a request, through the loaded model's per-image feature cache."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine_daemon.models.vision_support import FEATURE_ENCODERS, VisionSupport
from engine_daemon.multimodal.inputs import VisionInputs


def image_features(model: Any, support: VisionSupport, inputs: VisionInputs) -> mx.array | None:
    """Projected features of the request's images, reusing cached ones; None when not cacheable."""
    encoder = FEATURE_ENCODERS.get(support.model_type)
    grid = inputs.extra.get("image_grid_thw")
    if encoder is None or inputs.pixel_values is None or grid is None or grid.shape[0] != len(inputs.image_keys):
        return None
    rows = [int(t) * int(h) * int(w) for t, h, w in grid.tolist()]
    features, start = [], 0
    for index, key in enumerate(inputs.image_keys):
        cached = support.features.get(key)
        if cached is None:
            cached = encoder(model, inputs.pixel_values[start:start + rows[index]], grid[index:index + 1])
            mx.eval(cached)
            support.features.put(key, cached)
        features.append(cached)
        start += rows[index]
    return features[0] if len(features) == 1 else mx.concatenate(features, axis=0)
