"""`PromptScoring` on a real tiny model in process: slices add up to one pass, and the KV it leaves is a prefill's."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine_daemon.request.state import EngineRequest
from engine_daemon.scheduling.prompt_scoring import PromptScoring
from engine_daemon.scheduling.scoring_budget import (
    BETWEEN,
    FIRST_SLICE,
    GAP_SHARE,
    IDLE,
    LOGIT_BYTES,
    MIN_SLICE,
    RIDING,
    RIDING_FIRST,
    RIDING_GROWTH,
    RIDING_SHARE,
    RIDING_WINDOW,
    SliceBudget,
)
from engine_daemon.scheduling.scoring_job import ScoringJob
from protocol import MsgType


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from mlx_lm import load

    from model_builders.text import build_model

    path: Path = build_model(tmp_path_factory.mktemp("scoring") / "tiny", size="tiny", seed=0)
    return load(str(path))


def request_for(tokens: list[int], top: int | None = 2, rid: str = "r1") -> EngineRequest:
    request = EngineRequest(rid, b"peer", {"params": {"prompt_logprobs": top}})
    request.prompt_tokens = tokens
    return request


def test_slices_give_the_logprobs_and_kv_of_one_pass(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    tokens = tokenizer.encode("Scoring a prompt in slices must not change a single number of it. " * 4)
    whole, sliced = ScoringJob(request_for(tokens), model, tokenizer), ScoringJob(request_for(tokens), model, tokenizer)
    whole.step(10_000)
    entries_whole = whole.unsent()
    entries_sliced = []
    for _ in range(len(tokens)):
        if not sliced.finished:
            sliced.step(7)
            entries_sliced += sliced.unsent()
    assert whole.finished and sliced.finished and whole.done == sliced.done == len(tokens) - 1
    assert len(entries_whole) == len(entries_sliced) == len(tokens)
    assert entries_whole[0]["logprob"] is None and entries_whole[0]["top_logprobs"] is None
    for a, b in zip(entries_whole[1:], entries_sliced[1:], strict=True):
        assert a["token"] == b["token"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert a["top_logprobs"][0]["logprob"] >= a["top_logprobs"][1]["logprob"]  # most likely first
    # The KV holds every position but the last, as a batch prefill of the same tokens leaves it.
    assert whole.cache[0].offset == sliced.cache[0].offset == len(tokens) - 1
    keys_whole, keys_sliced = (job.cache[0].keys[..., :len(tokens) - 1, :] for job in (whole, sliced))
    assert mx.allclose(keys_whole, keys_sliced, atol=1e-5).item()
    # A token's logprob is the one a forward pass over the whole prompt gives.
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
    table = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert entries_whole[5]["logprob"] == pytest.approx(table[4, tokens[5]].item(), abs=1e-4)


def test_tick_sends_each_slice_and_hands_the_kv_over(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    tokens = tokenizer.encode("one two three four five six seven eight nine ten " * 3)
    scoring = PromptScoring(SliceBudget(idle_tokens=10))
    request = request_for(tokens, top=0)
    scoring.add(request, model, tokenizer)
    sent, through = [], []
    while scoring:
        events, done = scoring.tick(None, 2048)
        sent += [body["prompt_logprobs"] for _, kind, body in events if kind == MsgType.DELTAS]
        through += done
    assert [len(entries) for entries in sent][:2] == [11, 10]  # the first token's entry, then 10 a slice
    assert sum(map(len, sent)) == len(tokens) and scoring.slices == len(sent)
    assert through == [request] and request.prompt_scored
    assert request.preempted.context == tokens[:-1] and request.preempted.rest == tokens[-1:]
    assert all(entry["top_logprobs"] == [] for entries in sent for entry in entries[1:])
    single = request_for(tokens[:1], rid="r2")
    scoring.add(single, model, tokenizer)
    events, done = scoring.tick(None, 2048)
    assert done == [single] and single.prompt_scored and single.preempted is None  # no KV: it prefills as any
    assert events[0][2]["prompt_logprobs"][0]["logprob"] is None


def test_budget_follows_the_gap_target_the_stall_bound_and_the_vocabulary(loaded: tuple[Any, Any]) -> None:
    budget = SliceBudget(max_gap_ratio=3.0, idle_tokens=2048)
    assert budget.size(IDLE, None, 32_000) == min(2048, LOGIT_BYTES // (4 * 32_000))
    assert budget.size(IDLE, None, 1_000_000) == MIN_SLICE
    assert budget.size(BETWEEN, 0.05, 32_000) == FIRST_SLICE  # nothing measured yet
    assert budget.size(RIDING, 0.05, 32_000) == RIDING_FIRST
    budget.observe(BETWEEN, 100, 0.1)  # 100 positions took 0.1 s: the room past a 0.05 s decode step holds this many
    assert budget.size(BETWEEN, 0.05, 32_000) == int(100 * GAP_SHARE * 2.0 * 0.05 / 0.1)
    assert budget.size(RIDING, 0.05, 32_000) == RIDING_FIRST  # each kind by its own
    # Riding: the rate over the last steps (a step's time holds part of the slice before), growing 1.25x at most.
    budget.observe(RIDING, 40, 0.02)
    budget.observe(RIDING, 40, 0.06)  # 80 positions in 0.08 s: 1 ms each; the room is 0.5 * 2 * 0.05 s = 50 ms
    assert budget.size(RIDING, 0.05, 32_000) == int(min(RIDING_GROWTH * 40 + MIN_SLICE, RIDING_SHARE * 0.1 / 0.001))
    for _ in range(RIDING_WINDOW):
        budget.observe(RIDING, 100, 0.2)  # 2 ms a position: 25 positions fill the room
    assert budget.size(RIDING, 0.05, 32_000) == 25
    budget.observe(BETWEEN, 100, 0.01)  # ten times too fast: at most twice the last slice
    assert budget.size(BETWEEN, 0.05, 32_000) == 200
    budget.observe(BETWEEN, 20, 1.0)
    assert budget.size(BETWEEN, 0.05, 32_000) == MIN_SLICE
    # Nothing decoding: as large as the logits cap allows, unless --max-stall-seconds bounds the pass.
    budget.observe(IDLE, 500, 2.0)
    assert budget.size(IDLE, None, 32_000) == min(2048, LOGIT_BYTES // (4 * 32_000))
    stalled = SliceBudget(idle_tokens=2048, max_stall=1.0)
    stalled.observe(IDLE, 500, 2.0)  # 500 positions took 2 s: a 1 s pass holds 250
    assert stalled.size(IDLE, None, 32_000) == 250
    model, tokenizer = loaded
    scoring = PromptScoring()
    a, b = request_for([1, 2, 3]), request_for([4, 5, 6], rid="r2")
    scoring.add(a, model, tokenizer)
    scoring.add(b, model, tokenizer)
    scoring.remove({id(a)})
    assert scoring.requests() == [b]


def test_a_failing_pass_fails_its_request_only(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded

    class Broken:
        """The model, whose forward pass fails (memory, a bug) after its cache was made."""

        layers = model.layers

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("out of memory")

    broken = Broken()
    scoring = PromptScoring()
    bad, good = request_for([1, 2, 3, 4]), request_for([5, 6, 7, 8], rid="r2")
    scoring.add(bad, broken, tokenizer)
    scoring.add(good, model, tokenizer)
    events, done = scoring.tick(None, 2048)
    assert done == [] and events[0][1] == MsgType.ERROR and events[0][2]["rid"] == "r1"
    assert scoring.requests() == [good]
    events, done = scoring.tick(None, 2048)
    assert done == [good] and events[0][1] == MsgType.DELTAS


def test_the_cpu_log_softmax_equals_mlx() -> None:
    from engine_daemon.scheduling.scoring_job import _numpy_logprobs

    logits = mx.random.normal((6, 300), key=mx.random.key(3)) * 4
    table = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = [5, 0, 299, 17, 42, 100]
    chosen, ids, values = _numpy_logprobs(np.array(logits), targets, 3)
    assert chosen == pytest.approx([table[i, t].item() for i, t in enumerate(targets)], abs=1e-5)
    best = mx.sort(table, axis=-1)[:, ::-1][:, :3].tolist()
    for row, expected in zip(values, best, strict=True):
        assert sorted(row, reverse=True) == pytest.approx(expected, abs=1e-5)
    assert all(table[i, ids[i][j]].item() == pytest.approx(values[i][j], abs=1e-5) for i in range(6) for j in range(3))


def test_the_batch_scores_only_while_a_slot_is_free(loaded: tuple[Any, Any]) -> None:
    """`BatchScheduler._score_prompts`: a prompt through holds its KV until it joins, so none goes through while
    every decode slot is taken; with one free, the slice runs and the request joins the queue's front."""
    from types import SimpleNamespace

    from engine_daemon.scheduling.batch import BatchScheduler

    model, tokenizer = loaded
    scoring = PromptScoring()
    request = request_for(tokenizer.encode("a few words to score"))
    request.max_tokens = 4
    scoring.add(request, model, tokenizer)
    scheduler = SimpleNamespace(scoring=scoring, by_uid={1: object()}, config=SimpleNamespace(decode_concurrency=1),
                                pending=deque(), decoding=lambda: 0, generator=None,
                                models=SimpleNamespace(current=SimpleNamespace(vocab_size=2048)),
                                _fill_slots=lambda: [])
    assert BatchScheduler._score_prompts(scheduler) == [] and scoring.slices == 0  # type: ignore[arg-type]
    scheduler.by_uid = {}
    events = BatchScheduler._score_prompts(scheduler)  # type: ignore[arg-type]
    assert events[0][1] == MsgType.DELTAS and list(scheduler.pending) == [request] and request.prompt_scored


def test_clients_take_turns(loaded: tuple[Any, Any]) -> None:
    """An evaluation run's queue of prompts does not hold another client's prompt until it ends: the next job is the
    oldest of the client that started fewest (`PromptScoring._head`); a started job runs until it is through."""
    model, tokenizer = loaded
    scoring = PromptScoring(SliceBudget(idle_tokens=4))
    tokens = tokenizer.encode("each prompt here takes a few slices to score")

    def of(client: str, rid: str) -> EngineRequest:
        request = request_for(tokens, top=0, rid=rid)
        request.body["client"] = client
        return request

    for rid in ("a1", "a2", "a3"):
        scoring.add(of("eval", rid), model, tokenizer)
    through: list[str] = []
    events, done = scoring.tick(None, 2048)  # a1 starts
    scoring.add(of("chat", "b1"), model, tokenizer)
    through += [request.rid for request in done]
    while scoring:
        _, done = scoring.tick(None, 2048)
        through += [request.rid for request in done]
    assert through == ["a1", "b1", "a2", "a3"]
    assert not scoring._started  # turns count while the queue holds prompts: an empty queue forgets them
