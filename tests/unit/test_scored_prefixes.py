"""A prompt that shares a scored prefix is scored from where they part (`ScoredPrefixes`, `PromptScoring`).

On a real tiny model in process, with the real prefix cache: the second choice of a multiple-choice
question computes only its own tokens, and its entries and KV equal a cold run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine_daemon.prefix_cache.tiered import PrefixCache
from engine_daemon.request.state import EngineRequest
from engine_daemon.scheduling.prompt_scoring import PromptScoring
from engine_daemon.scheduling.scored_prefixes import ScoredPrefix, ScoredPrefixes
from engine_daemon.scheduling.scoring_budget import SliceBudget
from engine_daemon.scheduling.scoring_job import ScoringJob
from protocol import MsgType

KEY = ("model", None)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from mlx_lm import load

    from model_builders.text import build_model

    path: Path = build_model(tmp_path_factory.mktemp("scored") / "tiny", size="tiny", seed=0)
    return load(str(path))


def request_for(tokens: list[int], top: int | None = 2, rid: str = "r1", max_tokens: int = 1) -> EngineRequest:
    request = EngineRequest(rid, b"peer", {"params": {"prompt_logprobs": top}})
    request.prompt_tokens, request.max_tokens = tokens, max_tokens
    return request


def scoring_with_cache() -> tuple[PromptScoring, PrefixCache]:
    cache = PrefixCache(16, 1 << 30)
    return PromptScoring(SliceBudget(idle_tokens=7), fetch=cache.fetch, remember=cache.insert), cache


def scored(scoring: PromptScoring, request: EngineRequest, model: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """Every entry sent for `request`, its prompt run through to the end."""
    scoring.add(request, model, tokenizer, KEY)
    sent: list[dict[str, Any]] = []
    for _ in range(1000):  # bounded: a job that never finishes fails the test instead of hanging it
        if not scoring:
            break
        events, _ = scoring.tick(None, 2048)
        sent += [entry for _, kind, body in events if kind == MsgType.DELTAS for entry in body["prompt_logprobs"]]
    return sent


def assert_same_entries(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b) and a[0]["logprob"] is None and b[0]["logprob"] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x["token"] == y["token"] and x["logprob"] == pytest.approx(y["logprob"], abs=1e-5)
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]


def test_the_next_choice_is_scored_from_where_the_prompts_part(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    context = tokenizer.encode("Question: which of these words names a colour of the sky at noon? Answer:")
    first, second = context + tokenizer.encode(" green grass"), context + tokenizer.encode(" blue sky today")
    scoring, prefix_cache = scoring_with_cache()
    scored(scoring, request_for(first), model, tokenizer)
    assert scoring.reused_tokens == 0 and scoring.scored_tokens == len(first) - 1
    assert len(prefix_cache.memory) == 1  # the first prompt's KV, for later prompts scored or not

    request = request_for(second, rid="r2")
    entries = scored(scoring, request, model, tokenizer)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= len(context) - 1  # a tokenizer may merge the context's last token with the next word
    assert scoring.reused_tokens == request.cached_tokens == shared - 1  # each reused position has its row
    assert scoring.scored_tokens == len(first) - 1 + len(second) - shared  # computed: from where they part

    cold_scoring = PromptScoring(SliceBudget(idle_tokens=7))
    cold = request_for(second, rid="cold")
    assert_same_entries(entries, scored(cold_scoring, cold, model, tokenizer))
    # The KV it joins the batch with is the cold run's too.
    ours, theirs = request.preempted.cache, cold.preempted.cache
    assert ours[0].offset == theirs[0].offset == len(second) - 1
    assert mx.allclose(ours[0].keys[..., :len(second) - 1, :], theirs[0].keys[..., :len(second) - 1, :],
                       atol=1e-5).item()


def test_a_prompt_inside_a_scored_one_computes_nothing(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    tokens = tokenizer.encode("the whole of this prompt was scored before, and then a part of it again")
    scoring, _ = scoring_with_cache()
    whole = scored(scoring, request_for(tokens), model, tokenizer)
    before = scoring.scored_tokens
    part = request_for(tokens[:12], rid="r2", max_tokens=0)
    entries = scored(scoring, part, model, tokenizer)
    assert scoring.scored_tokens == before and scoring.reused_tokens == 11
    assert_same_entries(entries, whole[:12])


def test_more_alternatives_than_kept_are_computed_again(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    tokens = tokenizer.encode("alternatives kept for one request are not enough for another asking more")
    scoring, _ = scoring_with_cache()
    scored(scoring, request_for(tokens, top=1), model, tokenizer)
    entries = scored(scoring, request_for(tokens, top=3, rid="r2"), model, tokenizer)
    assert scoring.reused_tokens == 0 and all(len(entry["top_logprobs"]) == 3 for entry in entries[1:])
    fewer = scored(scoring, request_for(tokens, top=2, rid="r3"), model, tokenizer)
    assert scoring.reused_tokens == len(tokens) - 1  # three kept serve two
    assert all(len(entry["top_logprobs"]) == 2 for entry in fewer[1:])
    assert_same_entries(fewer, [{**e, "top_logprobs": (e["top_logprobs"] or [])[:2] or e["top_logprobs"]}
                                for e in entries])


def test_without_a_prefix_cache_nothing_is_reused(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    tokens = tokenizer.encode("no prefix cache, no reuse of its rows")
    scoring = PromptScoring(SliceBudget(idle_tokens=7))
    scored(scoring, request_for(tokens), model, tokenizer)
    scored(scoring, request_for(tokens, rid="r2"), model, tokenizer)
    assert scoring.reused_tokens == 0 and len(scoring.store) == 0


def prefix(tokens: list[int], top: int, key: Any = KEY) -> ScoredPrefix:
    rows = len(tokens) - 1
    values = [[-float(j + 1) for j in range(top)] for _ in range(rows)]
    return ScoredPrefix.of(key, tokens, [-1.0] * rows, [list(range(top)) for _ in range(rows)], values, top)


def test_the_store_finds_the_longest_with_enough_alternatives_and_keeps_its_cap() -> None:
    store = ScoredPrefixes(max_entries=3, max_bytes=1 << 20)
    store.insert(prefix([1, 2, 3, 4], top=1))
    store.insert(prefix([1, 2, 9], top=5))
    assert store.longest(KEY, [1, 2, 3, 4, 5], top=1)[1] == 4
    assert store.longest(KEY, [1, 2, 3, 4, 5], top=2)[1] == 2  # only the entry with five alternatives
    assert store.longest(("other", None), [1, 2, 3], top=0) is None  # another model or adapter
    assert store.longest(KEY, [7, 8], top=0) is None
    store.insert(prefix([1, 2, 3, 4, 5, 6], top=1))  # extends the first: it replaces it
    assert len(store) == 2
    for n in range(3):
        store.insert(prefix([50 + n, 1, 2], top=1))
    assert len(store) == 3 and store.longest(KEY, [1, 2, 9], top=5) is None  # least recently used went first
    assert store.nbytes == sum(entry.nbytes for entry in store._entries.values())


def test_kept_alternatives_are_most_likely_first() -> None:
    entry = ScoredPrefix.of(KEY, [1, 2, 3], [-0.5, -0.2], [[4, 5, 6], [7, 8, 9]],
                            [[-3.0, -1.0, -2.0], [-0.1, -0.3, -0.2]], 3)
    assert entry.top_ids.tolist() == [[5, 6, 4], [7, 9, 8]]
    assert np.allclose(entry.top_values, [[-1, -2, -3], [-0.1, -0.2, -0.3]])


def test_a_resumed_job_sends_every_row_once(loaded: tuple[Any, Any]) -> None:
    """Reused rows go out first (the first token's entry with them), then the computed ones, none twice."""
    model, tokenizer = loaded
    tokens = tokenizer.encode("rows sent once whether computed or reused, from a prefix scored before")
    earlier = ScoringJob(request_for(tokens), model, tokenizer, key=KEY)
    earlier.step(1000)
    expected = earlier.unsent()
    job = ScoringJob(request_for(tokens), model, tokenizer, key=KEY)
    reused = 9
    cache = PrefixCache(4, 1 << 30)
    cache.insert(KEY, tokens[:earlier.done], earlier.cache)  # trimmed to the reused positions on the way out
    kv, cached = cache.fetch(KEY, tokens[:reused + 1])
    assert cached == reused
    job.resume(kv, cached, earlier.scored())
    job.step(5)
    entries = job.unsent(4)  # a few at a time: reused rows first
    entries += job.unsent()
    job.step(1000)
    entries += job.unsent()
    assert len(entries) == len(tokens) and job.finished and job.emitted == len(tokens) and job.reused == reused
    assert_same_entries(entries, expected)


def test_reused_entries_go_out_a_bounded_number_a_tick(loaded: tuple[Any, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries are built on the engine's model thread (text and bytes of each token and alternative): a long reused
    prefix sends them over several ticks (`ENTRY_CALLS` a tick), in order, each once, before computing on."""
    from engine_daemon.scheduling import prompt_scoring

    model, tokenizer = loaded
    monkeypatch.setattr(prompt_scoring, "ENTRY_CALLS", 3 * 10)  # ten entries a tick with two alternatives each
    tokens = tokenizer.encode("a long prefix scored once, whose entries a later prompt sends in bounded ticks " * 3)
    scoring, _ = scoring_with_cache()
    scored(scoring, request_for(tokens), model, tokenizer)
    longer = tokens + tokenizer.encode(" and then some more")
    scoring.add(request_for(longer, rid="r2"), model, tokenizer, KEY)
    sizes, entries = [], []
    for _ in range(1000):
        if not scoring:
            break
        events, _ = scoring.tick(None, 2048)
        for _, kind, body in events:
            if kind == MsgType.DELTAS:
                sizes.append(len(body["prompt_logprobs"]))
                entries += body["prompt_logprobs"]
    assert scoring.reused_tokens >= len(tokens) - 1 and max(sizes) == 10 and len(sizes) >= len(tokens) // 10
    assert_same_entries(entries, scored(PromptScoring(SliceBudget(idle_tokens=7)), request_for(longer, rid="cold"),
                                        model, tokenizer))
