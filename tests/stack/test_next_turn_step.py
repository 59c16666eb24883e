"""A conversation's next turn is prefilled in one step beside a running stream (`PrefillPacer.turn_chunk`), and
that step hands back its first token (`StallFreeBatchGenerator._step_ending`).

`--max-gap-ratio 1.01` makes the pacer give a prompt beside a stream its smallest chunk, so a
fresh prompt of the same length (the control) goes in many small steps; the next turn (a short
prompt after a long cached prefix) still goes in one. Read from the engine's own step trace.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Frontend, running_stack, stream_running

STEP = re.compile(r"step [\d.]+ ms: (\d+) decoding, (\d+) prompt tokens")
NEW_WORDS = 60  # the next turn's new text: ~120 tokens, under the 256 a next turn may add


@pytest.fixture(scope="module")
def stack(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Frontend, Path]]:
    logs = tmp_path_factory.mktemp("turn-logs")
    with running_stack(f"ipc://{ipc_dir}/turn.sock", logs, model=str(tiny_model),
                       engine_args=["--max-gap-ratio", "1.01"],
                       env={"MLX_ENGINE_LOG_LEVEL": "DEBUG"}) as (_, frontend):
        yield frontend, logs / "engined.log"


def _chunks_beside_streams(log_path: Path, offset: int) -> list[int]:
    """Prompt tokens of each step after `offset` that prefilled (more than a last token) while a stream decoded."""
    steps = [(int(d), int(t)) for d, t in STEP.findall(log_path.read_text()[offset:])]
    return [tokens for decoding, tokens in steps if decoding >= 1 and tokens > 1]


def _early_first_tokens(frontend: Frontend) -> int:
    """The engine's count of first tokens handed back by their prompt's last chunk (`/stats`)."""
    stats = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
    return stats.get("engine", stats)["first_tokens_at_prefill_end"]


def test_a_next_turn_goes_in_one_step_and_a_fresh_prompt_is_paced(stack: tuple[Frontend, Path], model_id: str) -> None:
    frontend, log_path = stack
    url = f"{frontend.base_url}/v1/chat/completions"
    history = [{"role": "user", "content": " ".join(f"fact{j % 211}" for j in range(400))}]
    first = httpx.post(url, json={"model": model_id, "messages": history, "max_tokens": 4, "temperature": 0},
                       timeout=120)
    assert first.status_code == 200
    history += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
    new_text = " ".join(f"more{j % 97}" for j in range(NEW_WORDS))

    with stream_running(url, model_id, max_tokens=3000):
        offset = len(log_path.read_text())
        early_before = _early_first_tokens(frontend)
        turn = httpx.post(url, timeout=120, json={"model": model_id, "max_tokens": 2, "temperature": 0,
                                                  "messages": history + [{"role": "user", "content": new_text}]})
        assert turn.status_code == 200
        # Its first token came back from that step, not from a step of its own after it.
        assert _early_first_tokens(frontend) == early_before + 1
        usage = turn.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 256
        turn_new = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        turn_chunks = _chunks_beside_streams(log_path, offset)
        offset = len(log_path.read_text())
        fresh = httpx.post(url, timeout=120, json={"model": model_id, "max_tokens": 2, "temperature": 0,
                                                   "messages": [{"role": "user", "content": new_text + " fresh"}]})
        assert fresh.status_code == 200
        fresh_chunks = _chunks_beside_streams(log_path, offset)
    # The turn's new tokens, its last included (whose logits give its first token), in one step; the control in
    # several.
    assert turn_chunks == [turn_new], f"the next turn ({turn_new} new tokens) was split: {turn_chunks}"
    assert len(fresh_chunks) >= 2, f"the control was not paced: {fresh_chunks}"
