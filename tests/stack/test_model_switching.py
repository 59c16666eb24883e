"""Model switches under load: requests for the loaded model keep joining its batch for
`--model-switch-delay` seconds while a request for another model waits, then the batch drains,
the model switches, and later requests for the first model wait their turn (bounded, no starvation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from model_builders.text import derive_model
from model_builders.tokenizer import thinking_chat_template
from tests.helpers import Frontend, running_stack

DELAY = 1.0


@pytest.fixture(scope="module")
def served(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    root = tmp_path_factory.mktemp("switch-models")
    derive_model(tiny_model, root / "model-a", thinking_chat_template())
    derive_model(tiny_model, root / "model-b", thinking_chat_template())
    with running_stack(f"ipc://{ipc_dir}/switch.sock", tmp_path_factory.mktemp("switch-logs"),
                       model=str(root / "model-a"),
                       engine_args=["--model-dir", str(root), "--model-switch-delay", str(DELAY)]) as (_, frontend):
        yield frontend


def test_loaded_model_keeps_its_batch_within_the_delay_then_switches(served: Frontend) -> None:
    url = f"{served.base_url}/v1/chat/completions"
    finished: dict[str, float] = {}

    def ask(name: str, model: str, max_tokens: int) -> None:
        r = httpx.post(url, timeout=120, json={"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                                               "messages": [{"role": "user", "content": name}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        finished[name] = time.monotonic()

    def start(name: str, model: str, max_tokens: int) -> threading.Thread:
        thread = threading.Thread(target=ask, args=(name, model, max_tokens))
        thread.start()
        return thread

    loads_before = httpx.get(f"{served.base_url}/health").json()["engine"]["model_loads"]
    began = time.monotonic()
    long_a = start("a1", "model-a", 4000)  # keeps model-a's batch busy for seconds
    time.sleep(0.3)
    b = start("b1", "model-b", 8)  # waits for the switch
    time.sleep(0.2)
    short_a = start("a2", "model-a", 4)  # within the delay: joins model-a's running batch
    short_a.join()
    assert "a1" not in finished and "b1" not in finished  # a2 did not wait for the switch
    time.sleep(max(0.0, began + 0.5 + DELAY + 0.3 - time.monotonic()))
    late_a = start("a3", "model-a", 4)  # past the delay: waits behind model-b
    for thread in (long_a, b, late_a):
        thread.join()
    assert finished["a2"] < finished["a1"] < finished["b1"] < finished["a3"]
    # model-b loaded once for b1, model-a once more for a3: not once per alternation.
    assert httpx.get(f"{served.base_url}/health").json()["engine"]["model_loads"] == loads_before + 2
