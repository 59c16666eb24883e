"""A disk entry whose KV does not fit the model is never served (`kv_layout`), and what the engine writes always fits.

The entries are real: a prefill of the tiny model, taken out of a batch as the engine takes them
(`BatchKVCache.extract`), written by `DiskTier.store`, so their names and content hashes are valid.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models import gemma3_text, mamba2
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from engine_daemon.prefix_cache.disk import DiskTier, key_digest
from engine_daemon.prefix_cache.kv_layout import mismatch, model_layout
from engine_daemon.prefix_cache.tiered import PrefixCache

TOKENS = 300


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    return load(str(tiny_model))[0]


def written(model, max_kv_size: int | None = None) -> list:
    """The KV of TOKENS prompt tokens as the engine stores it: prefilled, then extracted from a batch."""
    cache = make_prompt_cache(model, max_kv_size)
    model(mx.arange(1, TOKENS + 1)[None], cache=cache)
    extracted = [type(layer).merge([layer]).extract(0) for layer in cache]
    mx.eval([layer.state for layer in extracted])
    return extracted


def rotating(cache: list) -> list:
    changed = []
    for layer in cache:
        other = RotatingKVCache(max_size=4096, keep=4)
        other.keys, other.values, other.offset, other._idx = layer.keys, layer.values, layer.offset, layer.offset
        changed.append(other)
    return changed


def with_arrays(cache: list, change) -> list:
    for layer in cache:
        layer.keys, layer.values = change(layer.keys), change(layer.values)
    return cache


FOREIGN = {  # the ways a file can hold KV that is not the model's
    "head_dim": lambda c: with_arrays(c, lambda a: a[..., :16]),
    "kv_heads": lambda c: with_arrays(c, lambda a: mx.concatenate([a, a], axis=1)),
    "dtype": lambda c: with_arrays(c, lambda a: a.astype(mx.float16)),
    "fewer_layers": lambda c: c[:1],
    "more_layers": lambda c: [*c, KVCache.from_state(c[0].state)],
    "rotating": rotating,
    "quantized": lambda c: [layer.to_quantized(group_size=32, bits=8) for layer in c],
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_an_entry_whose_kv_does_not_fit_the_model_is_skipped_counted_and_deleted(model, tmp_path: Path,
                                                                                  kind: str, caplog) -> None:
    """Red team: such a file (valid name and hash) joined the batch and failed it, the stream beside it too
    ("[concatenate] ... (1,1,1697,16), (1,1,256,32)"), or was served without a word (more layers, float16, a
    rotating cache)."""
    key = ("identity", None)
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    assert disk.store(key_digest(*key), np.arange(1, TOKENS + 1, dtype=np.int32), FOREIGN[kind](written(model)),
                      trimmable=True)
    (path,) = tmp_path.glob("*.safetensors")
    prefix = PrefixCache(8, 1 << 40, disk, model=lambda: model)
    with caplog.at_level(logging.WARNING, logger="engine_daemon.prefix_cache.disk"):
        assert prefix.fetch(key, list(range(1, TOKENS + 50))) == (None, 0)  # computed afresh
    assert disk.corrupt == 1 and disk.hits == 0 and not path.exists() and len(disk) == 0
    assert any("does not fit the model" in record.message for record in caplog.records)


@pytest.mark.parametrize("max_kv_size", [None, 512])
def test_what_the_engine_writes_fits_its_model(model, tmp_path: Path, max_kv_size: int | None) -> None:
    """No false alarm: the engine's own entries, plain and `--max-kv-size` (whose extracted rotating caches lose
    `keep`), load and serve."""
    key = ("identity", None)
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    assert disk.store(key_digest(*key), np.arange(1, TOKENS + 1, dtype=np.int32), written(model, max_kv_size),
                      trimmable=True)
    prefix = PrefixCache(8, 1 << 40, disk, model=lambda: model, max_kv_size=max_kv_size)
    cache, length = prefix.fetch(key, list(range(1, TOKENS + 50)))
    assert length == TOKENS and cache[0].offset == TOKENS and disk.corrupt == 0 and disk.hits == 1


def test_other_kinds_of_cache_are_compared_by_their_own_layout() -> None:
    """Models with their own `make_cache`: sliding-window layers (RotatingKVCache) and recurrent state (ArraysCache,
    no token axis); the model's layout is taken without evaluating anything."""
    sliding = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=2,
        head_dim=32, vocab_size=256, num_key_value_heads=1, sliding_window=16, sliding_window_pattern=2))
    recurrent = mamba2.Model(mamba2.ModelArgs(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=256, hidden_size=32, intermediate_size=64,
        state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=True, time_step_limit=(0.0, float("inf")), time_step_rank="auto"))
    for candidate in (sliding, recurrent):
        expected = model_layout(candidate)
        cache = make_prompt_cache(candidate)
        candidate(mx.arange(1, 41)[None], cache=cache)
        extracted = [type(layer).merge([layer]).extract(0) for layer in cache]
        assert mismatch(extracted, expected) is None
    assert "model's is RotatingKVCache max_size=16" in mismatch(written_plain(3), model_layout(sliding))
    state = extracted[0].cache
    extracted[0].cache = [state[0], mx.concatenate([state[1], state[1]], axis=1)]  # twice the heads
    assert "layer 0 is ArraysCache" in mismatch(extracted, model_layout(recurrent))


def written_plain(layers: int) -> list:
    caches = []
    for _ in range(layers):
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 1, 8, 32)), mx.zeros((1, 1, 8, 32)))
        caches.append(cache)
    return caches
