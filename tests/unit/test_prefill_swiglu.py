"""`prefill_swiglu` against mlx-lm's SwiGLU: same values to float rounding, and only a prompt's work takes it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from engine_daemon.cpu import parallel_ops, prefill_swiglu
from engine_daemon.cpu.prefill_scope import prefilling


@pytest.mark.parametrize("shape", [(1, 1, 8), (1, 7, 64), (3, 48, 2304), (1, 512, 256)])
def test_values_equal_mlx_lm_to_rounding(shape: tuple[int, ...]) -> None:
    mx.random.seed(sum(shape))
    gate, up = mx.random.normal(shape) * 6, mx.random.normal(shape)
    got = prefill_swiglu.swiglu(gate, up)
    want = mlx_lm_swiglu(gate, up)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=1e-6)


def test_extreme_gates_give_what_silu_gives() -> None:
    gate = mx.array([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4]])
    up = mx.full(gate.shape, 2.0)
    got = np.array(prefill_swiglu.swiglu(gate, up))
    assert np.isfinite(got).all()  # exp(-gate) overflows to inf for a very negative gate: the product is 0, not NaN
    np.testing.assert_allclose(got, np.array(mlx_lm_swiglu(gate, up)), rtol=2e-6, atol=1e-6)


def test_strided_inputs_are_read_as_laid_out() -> None:
    """A gate and up cut from one product (a fused gate_up projection) are views with strides."""
    both = mx.random.normal((2, 9, 2 * 96))
    gate, up = both[..., :96], both[..., 96:]
    np.testing.assert_allclose(np.array(prefill_swiglu.swiglu(gate, up)), np.array(mlx_lm_swiglu(gate, up)),
                               rtol=2e-6, atol=1e-6)


def test_only_a_prompts_float32_gate_on_the_cpu_is_claimed() -> None:
    gate = mx.zeros((2, 16))
    assert not prefill_swiglu.claims(gate, gate)  # a decode step: mlx-lm's kernel, evaluated asynchronously
    with prefilling():
        assert prefill_swiglu.claims(gate, gate)
        assert not prefill_swiglu.claims(gate.astype(mx.float16), gate.astype(mx.float16))
        assert not prefill_swiglu.claims(gate, mx.zeros((2, 1)))  # broadcasting: mlx-lm's
        prefill_swiglu.configure(False)
        try:
            assert not prefill_swiglu.claims(gate, gate)
        finally:
            prefill_swiglu.configure(True)


def test_the_installed_swiglu_dispatches_a_prompts_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    original = prefill_swiglu.swiglu
    monkeypatch.setattr(prefill_swiglu, "swiglu", lambda gate, up: calls.append(gate.shape) or original(gate, up))
    gate, up = mx.random.normal((4, 32)), mx.random.normal((4, 32))
    decode = parallel_ops.split_swiglu(gate, up)
    with prefilling():
        prompt = parallel_ops.split_swiglu(gate, up)
    assert calls == [(4, 32)]
    np.testing.assert_allclose(np.array(prompt), np.array(decode), rtol=2e-6, atol=1e-6)
