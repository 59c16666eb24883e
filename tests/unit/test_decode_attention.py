"""`decode_attention`: a decode step's attention at a long context takes the NumPy path, with MLX's results."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from engine_daemon.cpu import decode_attention, parallel_ops, prefill_attention
from engine_daemon.cpu.prefill_scope import prefilling
from tests.unit.test_prefill_attention import _close, _inputs, mlx_lm_functions_restored  # noqa: F401 (fixture)


def test_only_long_context_decode_attention_on_the_cpu_is_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_attention, "MIN_SCORES", 5 * 14 * 300)
    q, k, _ = _inputs(5, 14, 2, 1, 300)
    assert decode_attention.claims(q, k, None, None, None)
    short_q, short_k, _ = _inputs(5, 14, 2, 1, 299)
    assert not decode_attention.claims(short_q, short_k, None, None, None)  # below MIN_SCORES: MLX's, asynchronous
    several, keys, _ = _inputs(5, 14, 2, 3, 300)
    assert not decode_attention.claims(several, keys, None, "causal", None)  # a speculative step's queries
    assert not decode_attention.claims(q, k, None, None, mx.zeros((14,)))  # attention sinks: MLX's
    assert not decode_attention.claims(q, k, type("Quantized", (), {"bits": 8})(), None, None)
    with prefilling():  # a prompt's (or a fused step's) attention is `prefill_attention`'s
        assert not decode_attention.claims(q, k, None, None, None) and prefill_attention.claims(q, k, None, None, None)
    decode_attention.configure(False)
    try:
        assert not decode_attention.claims(q, k, None, None, None) and not decode_attention.enabled()
    finally:
        decode_attention.configure(True)
    assert decode_attention.enabled()


def test_mlx_lm_attention_of_a_long_decode_step_goes_the_numpy_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """`split_sdpa` (what mlx-lm's models call once `install` ran): a left-padded batch's decode step at 2,000 tokens
    is computed by `prefill_attention.attention` and equals MLX's own to float rounding."""
    calls: list[tuple[int, ...]] = []
    original = prefill_attention.attention
    monkeypatch.setattr(prefill_attention, "attention", lambda q, *rest: calls.append(q.shape) or original(q, *rest))
    q, k, v = _inputs(4, 14, 2, 1, 2000, dim=64)
    mask = create_causal_mask(1, offset=1999, left_padding=mx.array([0, 300, 1000, 1990]))
    _close(parallel_ops.split_sdpa(q, k, v, None, 0.125, mask),
           mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))
    assert calls == [(4, 14, 1, 64)]
    small = _inputs(1, 4, 2, 1, 50)
    parallel_ops.split_sdpa(*small, None, 0.125, None)
    assert len(calls) == 1  # 200 scores: MLX's


def test_a_real_continuous_batch_decodes_the_same_tokens(tmp_path_factory: pytest.TempPathFactory,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm's own BatchGenerator on a real model file, long-context decode off then on (every decode step claimed):
    greedy tokens equal, logprobs equal to rounding, and the decode steps' attention went the NumPy way."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from model_builders.text import build_model

    def run(model) -> dict[int, list[tuple[int, mx.array]]]:
        generator = BatchGenerator(model, max_tokens=12, prefill_step_size=64)
        prompts = [list(range(5, 5 + n)) for n in (90, 40, 17)]
        steps = {uid: [] for uid in generator.insert(prompts)}
        while sum(len(v) for v in steps.values()) < 12 * len(prompts):
            for response in generator.next_generated():
                steps[response.uid].append((response.token, response.logprobs))
        generator.close()
        return steps

    path = build_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", size="tiny", seed=0, arch="qwen2")
    model, _ = load(str(path))
    parallel_ops.install()
    monkeypatch.setattr(decode_attention.switch, "on", False)
    stock = run(model)
    monkeypatch.setattr(decode_attention.switch, "on", True)
    monkeypatch.setattr(decode_attention, "MIN_SCORES", 1)
    decoded: list[int] = []
    original = prefill_attention.attention

    def counted(queries: mx.array, *rest):
        if not prefill_attention.active():  # not a prompt's: a decode step's
            decoded.append(queries.shape[2])
        return original(queries, *rest)

    monkeypatch.setattr(prefill_attention, "attention", counted)
    ours = run(model)
    assert decoded.count(1) >= 2 * 10  # both layers of the decode steps
    for uid, steps in stock.items():
        assert [t for t, _ in ours[uid]] == [t for t, _ in steps]
        for (_, a), (_, b) in zip(steps, ours[uid]):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def test_masks_numpy_cannot_read_or_index_are_handled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: an MLA model's additive mask is bfloat16 in a bfloat16 model (NumPy has no such dtype: the step
    raised), and a rotating cache's window mask can be one-dimensional (`mask.shape[-2]` raised). The first is
    added as float32; the second is left to MLX's attention."""
    monkeypatch.setattr(decode_attention, "MIN_SCORES", 1)
    q, k, v = (x.astype(mx.bfloat16) for x in _inputs(2, 4, 4, 1, 300))
    mask = (mx.random.normal((2, 4, 1, 300)) * 0.1).astype(mx.bfloat16)
    assert decode_attention.claims(q, k, None, mask, None)
    got = parallel_ops.split_sdpa(q, k, v, None, 0.125, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=2e-2)
    window = mx.arange(300) >= 50
    assert not decode_attention.claims(q, k, None, window, None)
    np.testing.assert_array_equal(  # MLX's own, so bitwise
        np.array(parallel_ops.split_sdpa(q, k, v, None, 0.125, window).astype(mx.float32)),
        np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=window).astype(mx.float32)))
