"""Fair pre-emption: one client's burst that took every decode slot gives one back to another client.

Judged on what the engine reports (its `requests_preempted` counter and the order of its `finished`
log lines), and on the paused requests' text, which must equal the same requests run without a pause.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, client_for, running_stack

BURST = [  # client "a": greedy, and sampled with a seed (its key chain must go on after the pause)
    {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}], "temperature": 0},
    {"messages": [{"role": "user", "content": "Write a long story about a harbour."}], "temperature": 0.9,
     "seed": 7},
]


@pytest.fixture(scope="module")
def two_slots(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Engine, Frontend]]:
    with running_stack(f"ipc://{ipc_dir}/fair.sock", tmp_path_factory.mktemp("fair"), model=str(tiny_model),
                       engine_args=["--decode-concurrency", "2"]) as stack:
        yield stack


def stats(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def finished_order(engine: Engine) -> list[str]:
    return re.findall(r"rid=(\S+) finished", engine.log())


def test_a_burst_holding_every_slot_gives_one_to_another_client(two_slots: tuple[Engine, Frontend],
                                                                model_id: str) -> None:
    engine, frontend = two_slots
    client = client_for(frontend)
    before = stats(frontend)["requests_preempted"]
    texts: dict[int, str] = {}
    rids: dict[int, str] = {}
    decoding = threading.Barrier(len(BURST) + 1)

    def stream(index: int) -> None:
        chunks, waited = [], False
        with client.chat.completions.with_streaming_response.create(
                model=model_id, max_tokens=700, stream=True, user="a", extra_body={"ignore_eos": True},
                **BURST[index]) as raw:
            rids[index] = raw.headers["x-request-id"]
            for chunk in raw.parse():
                chunks.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
                if not waited and len(chunks) >= 40:  # well past the pause threshold
                    waited = True
                    decoding.wait(timeout=60)
        texts[index] = "".join(chunks)

    burst = [threading.Thread(target=stream, args=(i,)) for i in range(len(BURST))]
    for thread in burst:
        thread.start()
    decoding.wait(timeout=60)
    other = client.chat.completions.with_raw_response.create(
        model=model_id, max_tokens=8, temperature=0, user="b", messages=[{"role": "user", "content": "Hi"}])
    for thread in burst:
        thread.join(timeout=120)
    preempted = stats(frontend)["requests_preempted"]
    assert preempted >= before + 1
    metrics = httpx.get(f"{frontend.base_url}/metrics", timeout=10).text
    assert re.search(rf"^mlx_engine_requests_preempted_total(\{{[^}}]*\}})? {preempted}$", metrics, re.M), metrics
    order = finished_order(engine)
    other_rid = other.headers["x-request-id"]
    # The other client's request ended before the burst's: it did not wait for a slot to free.
    assert all(order.index(other_rid) < order.index(rids[i]) for i in rids), order
    # Paused and resumed, each burst request says exactly what it says when nothing pauses it.
    for index, body in enumerate(BURST):
        alone = client.chat.completions.create(model=model_id, max_tokens=700, user="a",
                                               extra_body={"ignore_eos": True}, **body)
        assert texts[index] == alone.choices[0].message.content, index
