"""The Responses store's byte cap bounds the memory it really holds (attack 8 of the isolation issue)."""

from __future__ import annotations

import gc
import tracemalloc

from engine_daemon.calls.response_store import ResponseStore


def test_a_record_of_many_small_maps_costs_what_the_cap_counts() -> None:
    cap = 4 * 2**20
    store = ResponseStore(max_bytes=cap)
    tracemalloc.start()
    try:
        for index in range(6):
            record = {"metadata": [{} for _ in range(500_000)]}  # 0.5 MB packed, ~30 MB as Python objects
            assert store.put(f"resp_{index}", record)
            del record
            gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert store.bytes <= cap
    assert held < 2 * cap  # decoded records would hold ~60x their packed size
    assert store.get("resp_5") == {"metadata": [{}] * 500_000}
