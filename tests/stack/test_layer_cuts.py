"""A prompt beside a stream whose steps run late is cut between layers (`LayerCarry`), and answers as it would alone.

`--max-gap-ratio 1.05` puts the step's bound under a decode step, so every fused step with a chunk
runs late and its chunk leaves the pass after the first half of the layers; the next step takes its
rows in again where they stopped. The prompt is long enough (~3,000 tokens) for several cuts however
large the chunks a loaded machine's timings give the pacer: at ~1,000 tokens a CI run saw only two.
The newcomer's greedy reply must be the one it gets prefilled alone at full speed (no prefix cache,
so nothing is reused), and the engine must report the cuts: in its step trace and in /stats.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Frontend, running_stack, stream_running

CUT = re.compile(r"step [\d.]+ ms: (\d+) decoding, \d+ prompt tokens \(chunk \d+, fused, cut at layer (\d+), ")


@pytest.fixture(scope="module")
def stack(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Frontend, Path]]:
    logs = tmp_path_factory.mktemp("cut-logs")
    with running_stack(f"ipc://{ipc_dir}/cuts.sock", logs, model=str(tiny_model),
                       engine_args=["--max-gap-ratio", "1.05", "--prompt-cache-size", "0"],
                       env={"MLX_ENGINE_LOG_LEVEL": "DEBUG"}) as (_, frontend):
        yield frontend, logs / "engined.log"


def test_a_prompt_cut_between_layers_answers_as_it_would_alone(stack: tuple[Frontend, Path], model_id: str) -> None:
    frontend, log_path = stack
    url = f"{frontend.base_url}/v1/chat/completions"
    body = {"model": model_id, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(f"carry{j % 157}" for j in range(900))}]}
    alone = httpx.post(url, timeout=120, json=body)
    assert alone.status_code == 200

    with stream_running(url, model_id, max_tokens=6000):
        offset = len(log_path.read_text())
        beside = httpx.post(url, timeout=120, json=body)
        assert beside.status_code == 200
        cuts = [(int(decoding), int(layer)) for decoding, layer in CUT.findall(log_path.read_text()[offset:])]
    assert (beside.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert len(cuts) >= 3 and all(decoding >= 1 and layer == 1 for decoding, layer in cuts), cuts
    assert beside.json()["choices"][0]["message"]["content"] == alone.json()["choices"][0]["message"]["content"]
    stats = httpx.get(f"{frontend.base_url}/stats", timeout=30).json()
    assert _found(stats, "prefill_layer_cuts") >= len(cuts)


def _found(tree: object, key: str) -> int:
    """The first value under `key` anywhere in a nested /stats document."""
    if isinstance(tree, dict):
        if key in tree:
            return int(tree[key])
        for value in tree.values():
            found = _found(value, key)
            if found >= 0:
                return found
    return -1
