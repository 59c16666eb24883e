"""Per-request samplers: values a client may send never break the shared random key."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_k

from engine_daemon.sampling.samplers import make_request_sampler, recover_random_state


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("top_k", [1, 99, 100, 10**6])
def test_any_top_k_samples_and_leaves_the_key_usable(top_k: int, seed: int | None) -> None:
    logprobs = mx.log(mx.softmax(mx.random.normal((2, 100)), axis=-1))
    sampler = make_request_sampler({"temperature": 1.0, "top_k": top_k, "seed": seed, "top_p": 0.9})
    tokens = sampler(logprobs)
    mx.eval(tokens, mx.random.state)
    assert tokens.shape == (2,) and all(0 <= int(token) < 100 for token in tokens.tolist())
    if top_k == 1:  # still a filter where it is one
        assert tokens.tolist() == mx.argmax(logprobs, axis=-1).tolist()
    assert not recover_random_state()


def test_a_raise_inside_a_compiled_sampler_is_recovered_from() -> None:
    with pytest.raises(ValueError):
        apply_top_k(mx.zeros((1, 10)), 50)  # mlx-lm's own check, raised while its compile holds the key
    with pytest.raises(Exception, match="without a primitive"):
        mx.eval(mx.random.state)
    assert recover_random_state()
    draw = make_request_sampler({"temperature": 1.0})(mx.zeros((1, 10)))
    mx.eval(draw)
    assert not recover_random_state()


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_a_small_temperature_on_half_precision_logits_stays_inside_the_mask(dtype: mx.Dtype, seed: int | None) -> None:
    """1/temperature scaled float16 logits past 65504: every allowed token became -inf, the draw uniform."""
    masked = mx.where(mx.arange(2000) >= 1000, mx.log(mx.array(1 / 1000)), -mx.inf).astype(dtype)[None]
    sampler = make_request_sampler({"temperature": 2e-5, "seed": seed})
    draws = [int(sampler(masked).item()) for _ in range(20)]
    assert all(1000 <= token < 2000 for token in draws), draws
