"""The CPU op split (engine_daemon/cpu/parallel_ops.py): bitwise the same outputs as mlx-lm's, faster prefill.

The speed is measured in bench/ (bench/README.md); these tests prove the split
changes no number: the same logprobs at every step of a real continuous batch, for
real model files loaded by mlx_lm.load, and every mask shape attention can get.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from engine_daemon.cpu import parallel_ops as cpu_parallel
from engine_daemon.cpu import prefill_attention, prefill_swiglu
from model_builders.text import build_model


@pytest.fixture
def split_everything(monkeypatch: pytest.MonkeyPatch):
    """Splits every op whatever its size; mlx-lm's own functions are back in place afterwards."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and module is not None:
            for attr in ("swiglu", "scaled_dot_product_attention"):
                if hasattr(module, attr):
                    monkeypatch.setattr(module, attr, getattr(module, attr))
    monkeypatch.setattr(cpu_parallel, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(cpu_parallel, "MIN_SWIGLU_ELEMENTS", 1)
    monkeypatch.setattr(cpu_parallel, "_parts", 1)
    # Prompts' attention and SwiGLU through NumPy are close to MLX's, not bitwise: test_prefill_attention and
    # test_prefill_swiglu cover them.
    monkeypatch.setattr(prefill_attention.switch, "on", False)
    monkeypatch.setattr(prefill_swiglu.switch, "on", False)
    return cpu_parallel


def generate_batch(model, prompts: list[list[int]], max_tokens: int) -> dict[int, list[tuple[int, mx.array]]]:
    """(token, full logprobs) per step for each prompt, from a real mlx-lm continuous batch."""
    generator = BatchGenerator(model, max_tokens=max_tokens, prefill_step_size=16)
    uids = generator.insert(prompts[:-1])
    steps: dict[int, list[tuple[int, mx.array]]] = {uid: [] for uid in uids}
    finished: set[int] = set()
    late = None
    while len(finished) < len(prompts):
        for response in generator.next_generated():
            steps[response.uid].append((response.token, response.logprobs))
            if response.finish_reason is not None:
                finished.add(response.uid)
        if late is None:  # the last prompt joins a batch that is already decoding
            (late,) = generator.insert(prompts[-1:])
            steps[late] = []
    generator.close()
    return steps


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_split_batch_gives_bitwise_the_same_logprobs(arch: str, tmp_path_factory: pytest.TempPathFactory,
                                                      split_everything, monkeypatch: pytest.MonkeyPatch) -> None:
    path = build_model(tmp_path_factory.mktemp("models") / f"tiny-{arch}", size="tiny", seed=0, arch=arch)
    model, _ = load(str(path))
    # Mixed lengths: left padding gives attention an array mask; one prompt joins mid-batch.
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 17)] + [list(range(100, 160))]
    stock = generate_batch(model, prompts, max_tokens=12)
    assert split_everything.install() >= 2
    split_everything.configure(2)
    assert split_everything.active_parts() == 2
    splits: list[int] = []
    streams = cpu_parallel._streams
    monkeypatch.setattr(cpu_parallel, "_streams", lambda count: splits.append(count) or streams(count))
    split = generate_batch(model, prompts, max_tokens=12)
    assert len(splits) >= 2 * 2 * 12  # both functions, both layers, every step really went through streams
    assert [len(v) for v in split.values()] == [12] * len(prompts)
    for uid in stock:
        assert [t for t, _ in split[uid]] == [t for t, _ in stock[uid]]
        for (_, a), (_, b) in zip(stock[uid], split[uid]):
            assert mx.array_equal(a, b).item()


def test_install_rebinds_the_loaded_families_once(tiny_model: Path, split_everything) -> None:
    import mlx_lm.models.qwen2 as qwen2

    load(str(tiny_model))
    split_everything.install()
    assert qwen2.swiglu is cpu_parallel.split_swiglu
    assert qwen2.scaled_dot_product_attention is cpu_parallel.split_sdpa
    assert split_everything.install() == 0  # already rebound


def test_one_part_or_small_inputs_call_straight_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_parallel, "_parts", 1)
    assert cpu_parallel.active_parts() == 1
    gate, x = mx.random.normal((2, 3, 8)), mx.random.normal((2, 3, 8))
    monkeypatch.setattr(cpu_parallel, "_parts", 2)
    assert mx.array_equal(cpu_parallel.split_swiglu(gate, x), cpu_parallel._ORIGINAL_SWIGLU(gate, x)).item()


SDPA_CASES = [
    # (batch, heads, kv_heads, mask): batch >= 2 splits the batch, one sequence splits head groups
    (3, 4, 2, None),
    (3, 4, 2, "causal"),
    (3, 4, 2, "padded"),  # (batch, 1, q, k) boolean, like mlx-lm's left-padded batches
    (3, 4, 2, "additive"),  # (batch, heads, q, k) float
    (3, 4, 2, "square"),  # (q, k): broadcasts over batch and heads
    (1, 4, 2, "causal"),
    (1, 6, 3, "additive"),
    (1, 4, 2, "square"),
    (1, 4, 1, "causal"),  # one kv head: nothing to split, calls through
]


@pytest.mark.parametrize("batch,heads,kv_heads,mask_kind", SDPA_CASES)
@pytest.mark.parametrize("sinks", [False, True])
def test_split_attention_equals_mlx_for_every_mask_shape(batch: int, heads: int, kv_heads: int, mask_kind,
                                                         sinks: bool, split_everything) -> None:
    split_everything.configure(2)
    q_len, k_len, dim = 12, 20, 32
    mx.random.seed(batch * 100 + heads)
    queries = mx.random.normal((batch, heads, q_len, dim))
    keys = mx.random.normal((batch, kv_heads, k_len, dim))
    values = mx.random.normal((batch, kv_heads, k_len, dim))
    mask = {
        None: None,
        "causal": "causal",
        "padded": mx.random.uniform(shape=(batch, 1, q_len, k_len)) > 0.2,
        "additive": mx.random.normal((batch, heads, q_len, k_len)),
        "square": mx.random.normal((q_len, k_len)),
    }[mask_kind]
    head_sinks = mx.random.normal((heads,)) if sinks else None
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=dim ** -0.5, mask=mask,
                                                    sinks=head_sinks)
    got = cpu_parallel.split_sdpa(queries, keys, values, cache=None, scale=dim ** -0.5, mask=mask, sinks=head_sinks)
    assert got.shape == expected.shape
    assert mx.array_equal(got, expected).item()


def test_split_swiglu_along_the_sequence_of_one_prompt(split_everything) -> None:
    split_everything.configure(3)
    gate, x = mx.random.normal((1, 50, 64)), mx.random.normal((1, 50, 64))
    assert mx.array_equal(cpu_parallel.split_swiglu(gate, x), cpu_parallel._ORIGINAL_SWIGLU(gate, x)).item()


