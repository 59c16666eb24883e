"""A decode step at a long context takes the CPU's NumPy attention (`decode_attention`) and answers as MLX's would.

The tiny model has two query heads, so one sequence reaches the path's threshold (`MIN_SCORES`, 16,384 scores a
layer) past 8,192 tokens of context: the prompt here is ~9,000. The same greedy request goes to an engine on the
default (`--cpu-decode-attention numpy`) and to one on `mlx`; the replies must be the same text, and the engines'
own counters must say which path their decode steps took (every layer of every decode step on the first, none on
the second), so a threshold or routing change that silently keeps the daemon off the path fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.helpers import running_stack

LAYERS = 2  # the tiny preset's decoder layers
MAX_TOKENS = 12


def _answer(model: Path, ipc_dir: Path, logs: Path, path: str) -> tuple[dict, int, str]:
    """The reply, the engine's `cpu_decode_attention_layers` and its /metrics text, on `--cpu-decode-attention path`."""
    logs.mkdir()
    with running_stack(f"ipc://{ipc_dir}/decode-attention-{path}.sock", logs, model=str(model),
                       engine_args=["--cpu-decode-attention", path]) as (_, frontend):
        body = {"model": str(model), "max_tokens": MAX_TOKENS, "temperature": 0,
                "messages": [{"role": "user", "content": " ".join(f"w{j % 211}" for j in range(2600))}]}
        reply = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=300, json=body)
        assert reply.status_code == 200, reply.text
        stats = httpx.get(f"{frontend.base_url}/stats", timeout=30).json()
        if stats["cpu_decode_attention"] != path:
            pytest.skip("the engine runs on a GPU: the path is the CPU's")
        metrics = httpx.get(f"{frontend.base_url}/metrics", timeout=30).text
        return reply.json(), int(stats["cpu_decode_attention_layers"]), metrics


def test_a_long_context_decode_takes_the_numpy_path_and_answers_as_mlx(
        tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    numpy_reply, numpy_layers, metrics = _answer(tiny_model, ipc_dir, tmp_path / "numpy", "numpy")
    mlx_reply, mlx_layers, _ = _answer(tiny_model, ipc_dir, tmp_path / "mlx", "mlx")

    prompt_tokens = numpy_reply["usage"]["prompt_tokens"]
    assert prompt_tokens >= 8192, prompt_tokens  # one sequence, two heads: past the threshold from the first step
    decode_steps = numpy_reply["usage"]["completion_tokens"] - 1  # the first token comes from the prompt's pass
    assert decode_steps >= 1
    assert numpy_layers >= LAYERS * decode_steps, (numpy_layers, decode_steps)
    assert mlx_layers == 0
    exported = re.search(r"^mlx_engine_cpu_decode_attention_layers_total(?:\{[^}]*\})? (\d+)", metrics, re.M)
    assert exported and int(exported.group(1)) == numpy_layers
    assert numpy_reply["choices"][0]["message"]["content"] == mlx_reply["choices"][0]["message"]["content"]
    assert numpy_reply["usage"]["completion_tokens"] == mlx_reply["usage"]["completion_tokens"]
