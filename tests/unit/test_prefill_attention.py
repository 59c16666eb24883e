"""`prefill_attention` against MLX's own attention: same results to float rounding, for every mask mlx-lm passes."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.base import create_causal_mask

from engine_daemon.cpu import parallel_ops, prefill_attention, prefill_swiglu
from engine_daemon.cpu.prefill_scope import prefilling


@pytest.fixture(autouse=True)
def mlx_lm_functions_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """`parallel_ops.install` rebinds functions in mlx-lm's model modules: put mlx-lm's back afterwards."""
    importlib.import_module("mlx_lm.models.qwen2")
    importlib.import_module("mlx_lm.models.llama")
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and module is not None:
            for attr in ("swiglu", "scaled_dot_product_attention"):
                if hasattr(module, attr):
                    monkeypatch.setattr(module, attr, getattr(module, attr))


def _inputs(batch: int, heads: int, kv_heads: int, length: int, key_length: int, dim: int = 32):
    mx.random.seed(batch * 1000 + length)
    return (mx.random.normal((batch, heads, length, dim)), mx.random.normal((batch, kv_heads, key_length, dim)),
            mx.random.normal((batch, kv_heads, key_length, dim)))


def _close(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("length,offset", [(1, 0), (7, 0), (16, 300), (48, 1400)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (10, 2), (14, 2)])
def test_causal_chunk_after_a_cache_matches_mlx(length: int, offset: int, heads: int, kv_heads: int) -> None:
    q, k, v = _inputs(1, heads, kv_heads, length, offset + length)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.18, mask="causal" if length > 1 else None)
    _close(prefill_attention.attention(q, k, v, 0.18, "causal"), want)


def test_blocks_of_queries_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _inputs(1, 10, 2, 64, 200)
    whole = prefill_attention.attention(q, k, v, 0.125, "causal")
    monkeypatch.setattr(prefill_attention, "BLOCK_SCORES", 10 * 200 * 5)  # blocks of 5 queries: 13 of them
    _close(prefill_attention.attention(q, k, v, 0.125, "causal"), whole)
    _close(whole, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))


def test_right_padded_batch_mask_and_unmasked_call_match_mlx() -> None:
    q, k, v = _inputs(3, 10, 2, 12, 40)
    mask = create_causal_mask(12, offset=28, right_padding=mx.array([0, 3, 11]))  # (3, 1, 12, 40) bool
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    got = prefill_attention.attention(q, k, v, 0.2, mask)
    keep = np.array(mask).any(axis=-1)[:, 0]  # rows that see at least one key (padding rows may see none)
    np.testing.assert_allclose(np.array(got).transpose(0, 2, 1, 3)[keep], np.array(want).transpose(0, 2, 1, 3)[keep],
                               atol=2e-5, rtol=1e-4)
    assert np.isfinite(np.array(got)).all()  # a row that sees no key gives zeros, never NaN
    _close(prefill_attention.attention(q, k, v, 0.2, None), mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2))


def test_additive_per_head_mask_matches_mlx() -> None:
    q, k, v = _inputs(2, 6, 3, 5, 9)
    mask = mx.random.normal((2, 6, 5, 9))
    _close(prefill_attention.attention(q, k, v, 0.3, mask), mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3,
                                                                                                   mask=mask))


def test_decode_rows_of_a_left_padded_batch_match_mlx() -> None:
    """A fused step's decode rows: one query per sequence over a batch cache whose rows start at different places."""
    q, k, v = _inputs(4, 14, 2, 1, 600, dim=64)
    keys, values = mx.concatenate([k, k], axis=2)[:, :, :600], mx.concatenate([v, v], axis=2)[:, :, :600]  # views
    mask = create_causal_mask(1, offset=599, left_padding=mx.array([0, 50, 100, 599]))  # (4, 1, 1, 600) bool
    _close(prefill_attention.attention(q, keys, values, 0.125, mask),
           mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask))


def test_attentions_evaluated_together_give_what_each_gives_alone() -> None:
    """`evaluated_together` defers the softmaxes to its exit: built inside, the results are the same."""
    decode = _inputs(4, 14, 2, 1, 300)
    chunk = _inputs(1, 14, 2, 32, 332)
    mask = create_causal_mask(1, offset=299, left_padding=mx.array([0, 7, 30, 2]))
    alone = (prefill_attention.attention(*decode, 0.2, mask), prefill_attention.attention(*chunk, 0.2, "causal"))
    with prefill_attention.evaluated_together():
        together = (prefill_attention.attention(*decode, 0.2, mask), prefill_attention.attention(*chunk, 0.2, "causal"))
    for got, want in zip(together, alone):
        np.testing.assert_array_equal(np.array(got), np.array(want))


def test_scores_left_raw_when_the_block_fails_are_never_exponentiated_later() -> None:
    q, k, v = _inputs(1, 4, 2, 3, 3)
    with pytest.raises(RuntimeError), prefill_attention.evaluated_together():
        prefill_attention.attention(q, k, v, 0.2, "causal")
        raise RuntimeError("a failed step")
    _close(prefill_attention.attention(q, k, v, 0.2, "causal"),  # computed at once again: nothing left pending
           mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal"))


def test_only_prompt_attention_on_the_cpu_is_claimed() -> None:
    q, k, _ = _inputs(1, 4, 2, 3, 3)
    assert not prefill_attention.claims(q, k, None, "causal", None)  # a decode step or any call outside a prompt
    with prefilling():
        assert prefill_attention.claims(q, k, None, "causal", None)
        assert not prefill_attention.claims(q, k, None, "causal", mx.zeros((4,)))  # attention sinks: MLX's
        assert not prefill_attention.claims(q, k, type("Quantized", (), {"bits": 8})(), None, None)
        prefill_attention.configure(False)
        try:
            assert not prefill_attention.claims(q, k, None, "causal", None)
        finally:
            prefill_attention.configure(True)
    assert not prefill_attention.claims(q, k, None, "causal", None)


def test_install_marks_mlx_lm_prompt_processing_as_prefill() -> None:
    parallel_ops.install()
    seen: list[bool] = []

    def model(tokens: mx.array, cache: list) -> None:
        seen.append(prefill_attention.claims(mx.zeros((1, 2, tokens.shape[1], 4)), mx.zeros((1, 1, 4, 4)), None,
                                             "causal", None))

    batch = PromptProcessingBatch.empty(model, fallback_sampler=None)
    batch.uids, batch.tokens, batch.prompt_cache = [0], [[]], []
    batch.prompt([[1, 2, 3]])
    assert seen == [True]
    assert getattr(PromptProcessingBatch.prompt, "prefill_attention", False)
    parallel_ops.install()  # idempotent: wrapped once
    assert PromptProcessingBatch.prompt.__wrapped__.__name__ == "prompt"
    assert not getattr(PromptProcessingBatch.prompt.__wrapped__, "prefill_attention", False)


@pytest.mark.parametrize("arch,path", [("qwen2", prefill_attention), ("llama", prefill_attention),
                                       ("qwen2", prefill_swiglu)], ids=["qwen2", "llama", "qwen2-swiglu"])
def test_a_real_continuous_batch_gives_the_same_tokens(arch: str, path: ModuleType,
                                                      tmp_path_factory: pytest.TempPathFactory,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm's own BatchGenerator on a real model file, one NumPy path off then on: greedy tokens equal,
    logprobs equal to rounding (`prefill_swiglu` shares this test: it follows the same `prefilling` marks)."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from model_builders.text import build_model

    def run(model) -> dict[int, list[tuple[int, mx.array]]]:
        generator = BatchGenerator(model, max_tokens=10, prefill_step_size=16)
        prompts = [list(range(5, 5 + n)) for n in (3, 40, 17)]
        steps = {uid: [] for uid in generator.insert(prompts)}
        late = None
        while sum(len(v) for v in steps.values()) < 10 * (len(prompts) + 1):
            for response in generator.next_generated():
                steps[response.uid].append((response.token, response.logprobs))
            if late is None:  # a prompt that arrives while the others decode
                (late,) = generator.insert([list(range(100, 160))])
                steps[late] = []
        generator.close()
        return steps

    computed = "attention" if path is prefill_attention else "swiglu"
    path_on_disk = build_model(tmp_path_factory.mktemp("models") / f"tiny-{arch}", size="tiny", seed=0, arch=arch)
    model, _ = load(str(path_on_disk))
    parallel_ops.install()
    monkeypatch.setattr(path.switch, "on", False)
    stock = run(model)
    monkeypatch.setattr(path.switch, "on", True)
    rows: list[int] = []
    original = getattr(path, computed)
    monkeypatch.setattr(path, computed,
                        lambda first, *rest: rows.append(_rows(first, computed)) or original(first, *rest))
    ours = run(model)
    assert len(rows) >= 2 * 4 and max(rows) == 16  # both layers, every prompt's chunks, in mlx-lm's own loop
    for uid, steps in stock.items():
        assert [t for t, _ in ours[uid]] == [t for t, _ in steps]
        for (_, a), (_, b) in zip(steps, ours[uid]):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def _rows(first: mx.array, computed: str) -> int:
    """A prompt chunk's token count: queries are (B, heads, L, dim), a SwiGLU gate (B, L, width)."""
    return first.shape[2] if computed == "attention" else first.shape[1]
