"""The layout of a model's KV cache: what a prefix read from disk must have before it joins a batch.

Why: a disk entry's name covers the model identity and its content hash covers its bytes, but neither says
that its KV fits the model. A hand-made or foreign file (another model under the same identity, a writer's
bug) with another head dim, number of KV heads or of layers, or a quantized cache, was joined into the batch
and failed the whole step, the streams beside it too ("[concatenate] All the input array dimensions must
match exactly ... (1,1,1697,16), (1,1,256,32)"); an extra layer, float16 KV or a rotating cache was served
without a word. `DiskTier.load` now compares an entry with the layout the live model's own
`make_prompt_cache` has, and treats a difference like a damaged file (skipped, counted, deleted).

A layout holds per layer: the cache's class; its settings that change how the KV is read (a rotating cache's
`max_size`, a quantized one's `group_size` and `bits`, a chunked one's `chunk_size`; not `keep`, which
mlx-lm's `BatchRotatingKVCache.extract` drops from the caches it hands back); and per array of its state,
its place in the state, dtype and shape without the token axis (axis -2 of a KV cache's arrays, which an
`offset` marks; a recurrent `ArraysCache` state has no token axis: its whole shape). A `CacheList` holds
its caches' layouts. Only arrays' metadata is read, nothing is evaluated: ~5 µs per layer a load.

The model's own layout (`model_layout`): `make_prompt_cache` makes empty caches, so the model is called on
one token with them and the graph is built but never evaluated: MLX knows shapes and dtypes as it builds
(~0.1 ms per layer, once per model: `PrefixCache` keeps it). A model that cannot be called so
gives the layout without arrays: classes, settings and the number of layers are still compared.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, make_prompt_cache

log = logging.getLogger(__name__)

SETTINGS = ("max_size", "group_size", "bits", "chunk_size")  # how a cache reads its KV
Layout = tuple[Any, ...]  # one `_layer` per layer


def _layer(cache: Any, arrays: bool = True) -> tuple[Any, ...]:
    name = type(cache).__name__
    if isinstance(cache, CacheList):
        return (name, tuple(_layer(inner, arrays) for inner in cache.caches))
    settings = tuple((attr, getattr(cache, attr)) for attr in SETTINGS if hasattr(cache, attr))
    if not arrays:
        return (name, settings, None)
    tokens_axis = hasattr(cache, "offset")
    shapes = []
    for path, value in tree_flatten(cache.state):
        if isinstance(value, mx.array):
            shape = list(value.shape)
            if tokens_axis and len(shape) >= 2:
                shape[-2] = "*"
            shapes.append((path, tuple(shape), str(value.dtype).removeprefix("mlx.core.")))
    return (name, settings, tuple(shapes))


def layout_of(cache: list[Any], arrays: bool = True) -> Layout:
    """The layout of `cache` (one entry per layer); `arrays=False`: classes and settings only."""
    return tuple(_layer(layer, arrays) for layer in cache)


def model_layout(model: Any, max_kv_size: int | None = None) -> Layout:
    """The layout of the caches `make_prompt_cache(model, max_kv_size)` makes, as they are once they hold KV."""
    cache = make_prompt_cache(model, max_kv_size)
    try:
        model(mx.array([[0]], dtype=mx.int32), cache=cache)  # built, never evaluated: only shapes are wanted
    except Exception as exc:  # a model that needs more than tokens: compare what is known without arrays
        log.info("prompt cache: the KV shapes of %s are not known (%s): loads check classes only",
                 type(model).__name__, exc)
        return layout_of(make_prompt_cache(model, max_kv_size), arrays=False)
    return layout_of(cache)


def mismatch(cache: list[Any], expected: Layout) -> str | None:
    """How `cache` differs from the `expected` layout (the first difference, said for a log line), or None."""
    if len(cache) != len(expected):
        return f"it has {len(cache)} layers, the model {len(expected)}"
    arrays = _with_arrays(expected)
    for index, (layer, wanted) in enumerate(zip(cache, expected)):
        found = _layer(layer, arrays)
        if found != wanted:
            return f"layer {index} is {_describe(found)}, the model's is {_describe(wanted)}"
    return None


def _with_arrays(layout: Layout) -> bool:
    """Whether `layout` has its arrays' shapes (`model_layout` could call the model)."""
    return all(_with_arrays(layer[1]) if len(layer) == 2 else layer[2] is not None for layer in layout)


def _describe(layer: tuple[Any, ...]) -> str:
    if len(layer) == 2:  # a CacheList
        return f"{layer[0]}({', '.join(_describe(inner) for inner in layer[1])})"
    name, settings, shapes = layer
    text = name + "".join(f" {attr}={value}" for attr, value in settings)
    if shapes:
        text += " " + ", ".join(f"[{path}] {'x'.join(map(str, shape))} {dtype}" for path, shape, dtype in shapes)
    return text
