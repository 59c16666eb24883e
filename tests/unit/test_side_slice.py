"""A scored prompt's slices ride in the streams' decode steps (`SideSlice`, `GroupedGenerator.offer_side`,
`PromptScoring`): its logprobs and KV are those of a pass of its own, the streams' greedy tokens unchanged."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import StopSequences

from engine_daemon.errors import engine_failure
from engine_daemon.generation.grouped import GroupedGenerator
from engine_daemon.request.state import EngineRequest
from engine_daemon.scheduling.prompt_scoring import PromptScoring
from engine_daemon.scheduling.scoring_job import ScoringJob
from protocol import MsgType

DECODE_SECONDS = 0.05


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from mlx_lm import load

    from model_builders.text import build_model

    path: Path = build_model(tmp_path_factory.mktemp(request.param) / "m", size="tiny", arch=request.param, seed=0)
    return load(str(path))


def grouped(model: Any, fuse: bool = True) -> GroupedGenerator:
    config = SimpleNamespace(default_max_tokens=64, decode_concurrency=4, prompt_concurrency=2, prefill_step_size=64,
                             max_kv_size=None, fused_prefill=fuse)
    return GroupedGenerator(SimpleNamespace(model=model), config, None, SimpleNamespace(bind=lambda loaded, key: model))


def request_for(tokens: list[int], top: int = 2) -> EngineRequest:
    request = EngineRequest("scored", b"peer", {"params": {"prompt_logprobs": top}})
    request.prompt_tokens, request.max_tokens = tokens, 0
    return request


def run(generator: GroupedGenerator, prompts: list[list[int]], steps: int, scoring: PromptScoring | None = None,
        scored: EngineRequest | None = None, model: Any = None,
        tokenizer: Any = None) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The streams' greedy tokens; with `scoring`, `scored`'s prompt is scored once they all decode (its entries)."""
    n = len(prompts)
    uids = generator.insert(prompts, [steps] * n, [None] * n, [[] for _ in prompts], [None] * n, [[] for _ in prompts],
                            [StopSequences([]) for _ in prompts])
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    entries: list[dict[str, Any]] = []
    for _ in range(20 * steps):  # bounded: a job that never finishes fails the test instead of hanging it
        if not any(len(tokens) < steps for tokens in out.values()):
            break
        decoding = all(out.values())
        if scoring is not None and decoding and scored is not None and not scored.prompt_scored:
            if not scoring.jobs:
                scoring.add(scored, model, tokenizer)
            events, _ = scoring.tick(DECODE_SECONDS, 2048, generator)
            entries += [e for _, kind, body in events if kind == MsgType.DELTAS for e in body["prompt_logprobs"]]
        _, responses = generator.next()
        if scoring is not None:
            scoring.stepped(DECODE_SECONDS * 2, DECODE_SECONDS)
        for response in responses:
            out[response.uid].append(int(response.token))
    for _ in range(1000):  # the streams ended: what is left, with nothing decoding
        if scoring is None or not scoring.jobs:
            break
        events, _ = scoring.tick(None, 2048, generator)
        entries += [e for _, kind, body in events if kind == MsgType.DELTAS for e in body["prompt_logprobs"]]
    return [out[uid] for uid in uids], entries


def test_slices_ride_in_decode_steps_and_change_nothing(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    prompts = [tokenizer.encode(f"stream number {i} keeps decoding while a prompt is scored") for i in range(3)]
    tokens = tokenizer.encode("A prompt scored for its own logprobs, a slice in each of the streams' steps. " * 6)
    alone, _ = run(grouped(model), prompts, 40)

    scoring = PromptScoring()
    request = request_for(tokens)
    beside, entries = run(grouped(model), prompts, 40, scoring, request, model, tokenizer)
    assert beside == alone  # the streams' greedy tokens are those of steps without the slices
    assert scoring.riding_slices >= 2 and request.prompt_scored
    assert scoring.scored_tokens == len(tokens) - 1

    cold = ScoringJob(request_for(tokens), model, tokenizer)
    cold.step(10_000)
    expected = cold.unsent()
    assert len(entries) == len(expected) == len(tokens)
    for ours, theirs in zip(entries[1:], expected[1:], strict=True):
        assert ours["token"] == theirs["token"] and ours["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)
        assert [t["token"] for t in ours["top_logprobs"]] == [t["token"] for t in theirs["top_logprobs"]]
    # The KV the request would join the batch with is the one its own passes leave.
    joined = request.preempted.cache
    assert joined[0].offset == cold.cache[0].offset == len(tokens) - 1
    assert mx.allclose(joined[-1].keys[..., :len(tokens) - 1, :], cold.cache[-1].keys[..., :len(tokens) - 1, :],
                       atol=1e-4).item()


def test_without_fusion_slices_are_passes_of_their_own(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    prompts = [tokenizer.encode("one stream decoding")]
    tokens = tokenizer.encode("scored beside a model that does not fuse " * 12)
    scoring = PromptScoring()
    request = request_for(tokens, top=0)
    _, entries = run(grouped(model, fuse=False), prompts, 30, scoring, request, model, tokenizer)
    assert scoring.riding_slices == 0 and scoring.slices >= 2 and len(entries) == len(tokens)
    assert request.prompt_scored


def test_no_slice_while_a_prompt_is_prefilled_beside_the_streams(loaded: tuple[Any, Any]) -> None:
    """Its chunks have the gap's room: a slice beside them would make the streams wait for both."""
    model, tokenizer = loaded
    generator = grouped(model)
    scoring = PromptScoring()
    scoring.add(request_for(tokenizer.encode("waits for the prefill")), model, tokenizer)
    events, through = scoring.tick(DECODE_SECONDS, 2048, generator, prefilling=True)
    assert events == [] and through == [] and scoring.slices == 0 and scoring._offered is None


def test_a_failed_step_fails_the_prompt_whose_slice_rode_in_it(loaded: tuple[Any, Any]) -> None:
    """The fused pass wrote the slice's KV before the step failed: that prompt cannot go on from its cache."""
    model, tokenizer = loaded
    generator = grouped(model)
    prompts = [tokenizer.encode("a stream")]
    generator.insert(prompts, [50], [None], [[]], [None], [[]], [StopSequences([])])
    for _ in range(3):
        generator.next()
    scoring = PromptScoring()
    request = request_for(tokenizer.encode("scored while the step fails " * 8))
    scoring.add(request, model, tokenizer)
    scoring.add(request_for(tokenizer.encode("another prompt waiting")), model, tokenizer)
    scoring.tick(DECODE_SECONDS, 2048, generator)
    assert scoring._offered is not None
    group = generator._groups[None]
    decode = group._generation_batch

    def failing_next() -> Any:
        decode._step()  # the forward pass ran (the slice's KV written), then the step fails
        raise RuntimeError("out of memory")

    decode.next = failing_next
    with pytest.raises(RuntimeError):
        generator.next()
    assert generator._side is None  # offered for that step only
    error = engine_failure(RuntimeError("out of memory"))
    (event,) = scoring.step_failed(error)
    assert event[1] == MsgType.ERROR and event[2]["rid"] == "scored"
    assert scoring.requests() != [request] and len(scoring.jobs) == 1 and scoring.step_failed(error) == []
