"""Fair pre-emption never pauses a stream for a request that must wait anyway (`BatchScheduler._preempt`).

Review: `fair_slots.choose_victim` counted a request waiting for its prefix's disk read; the paused victim
retook the freed slot (the waiting one is skipped), was paused again, and `_fill_slots` recursed until a
`RecursionError` failed every request in flight. The real `_fill_slots`/`_preempt`/`_waits` run here over a
fake generator (every slot held by client H, one request of client C waiting).
"""

from __future__ import annotations

import types
from collections import deque

from engine_daemon.generation.grouped import GroupedGenerator
from engine_daemon.request.state import EngineRequest
from engine_daemon.scheduling.batch import BatchScheduler
from engine_daemon.scheduling.prefix_sharing import PrefillSharing
from engine_daemon.scheduling.prompt_progress import PromptProgress


def scheduler(reading: bool) -> tuple[BatchScheduler, dict]:
    s = object.__new__(BatchScheduler)
    s.config = types.SimpleNamespace(decode_concurrency=4, max_slots_per_key=0, fair_preemption=True,
                                     max_kv_size=None)
    s.models = types.SimpleNamespace(current=types.SimpleNamespace(kind="text", identity="m"))
    s.lockstep, s.pending, s.by_uid, s.uid_of = None, deque(), {}, {}
    s.sharing, s._prefill_progress = PrefillSharing(), PromptProgress()
    s.stats = types.SimpleNamespace(requests_preempted=0)
    s.prompt_cache = types.SimpleNamespace(reading=lambda key, prompt: reading and prompt[0] == 999)
    generator = object.__new__(GroupedGenerator)
    generator._where = {}
    counts = {"uid": 0, "inserts": 0}

    def remove(uids, return_prompt_caches=False):
        for uid in uids:
            generator._where.pop(uid)
        return {uid: ([types.SimpleNamespace(offset=9)], list(range(10))) for uid in uids}

    def insert(request: EngineRequest) -> None:
        request.preempted = None
        uid = counts["uid"]
        counts["uid"] += 1
        counts["inserts"] += 1
        generator._where[uid] = ("batch", 0)
        s.by_uid[uid], s.uid_of[request.rid] = request, uid

    generator.remove = remove
    s.generator, s._ensure_generator, s._insert = generator, lambda: None, insert
    s.accepted_event = lambda request: ("accepted", request.rid)
    for i in range(4):
        insert(EngineRequest(rid=f"h{i}", peer=b"", body={"client": "H", "params": {}},
                             prompt_tokens=[1] * 51, generated=20))
    s.pending.append(EngineRequest(rid="c0", peer=b"", body={"client": "C", "params": {}},
                                   prompt_tokens=[999] + [1] * 50))
    return s, counts


def test_no_stream_is_paused_for_a_request_waiting_for_its_read() -> None:
    s, counts = scheduler(reading=True)
    s._fill_slots()
    assert s.stats.requests_preempted == 0 and counts["inserts"] == 4 and [r.rid for r in s.pending] == ["c0"]


def test_a_request_that_may_start_still_gets_a_fair_slot() -> None:
    s, counts = scheduler(reading=False)
    s._fill_slots()
    assert s.stats.requests_preempted == 1 and "c0" in s.uid_of  # one of H's streams paused, C admitted
