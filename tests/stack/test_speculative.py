"""Speculative decoding (--draft-model) through the real stack.

Two engines: one drafting with a 1-layer cut of the tiny model (same tokenizer by
construction, model_builders/draft.py), one drafting with the model itself
(the mechanism's upper bound: every draft token is accepted). Greedy output must be
exactly the model's own, compared with mlx-lm and with the shared engine that has no
draft. Random weights make the acceptance rate of a real small draft meaningless; the
figures are printed (pytest -s) and bench/speculative.py measures them properly.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, client_for

PROMPTS = ["Tell me a story about a fox.", "What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def one_layer_draft(tiny_model: Path) -> Path:
    from model_builders.draft import build_truncated_draft

    return build_truncated_draft(tiny_model, tiny_model.parent / "tiny-draft-1layer", layers=1)


@pytest.fixture(scope="module")
def references(tiny_model: Path) -> dict[str, str]:
    """mlx-lm's own greedy text per prompt (with the model's shipped repetition penalty, as the server applies)."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = load(str(tiny_model))
    shipped = json.loads((tiny_model / "generation_config.json").read_text())
    processors = make_logits_processors(repetition_penalty=shipped.get("repetition_penalty"))
    return {prompt: generate(model, tokenizer, tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True), max_tokens=MAX_TOKENS,
        logits_processors=processors) for prompt in PROMPTS}


def start_stack(name: str, tiny_model: Path, draft: Path, ipc_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Frontend | None]:
    logs = tmp_path_factory.mktemp(f"{name}-logs")
    engine = Engine(f"ipc://{ipc_dir}/{name}.sock", logs / "engined.log", model=str(tiny_model),
                    args=["--draft-model", str(draft), "--num-draft-tokens", "3"])
    try:
        engine.wait_ready()
        frontend = Frontend(engine.endpoint, logs / "frontend.log", workers=1)
        frontend.wait_healthy()
    except Exception:
        engine.stop()
        raise
    return engine, frontend


@pytest.fixture(scope="module")
def speculative(tiny_model: Path, one_layer_draft: Path, ipc_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    engine, frontend = start_stack("spec-1layer", tiny_model, one_layer_draft, ipc_dir, tmp_path_factory)
    try:
        yield frontend
    finally:
        frontend.stop()
        engine.stop()


@pytest.fixture(scope="module")
def self_draft(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    engine, frontend = start_stack("spec-self", tiny_model, tiny_model, ipc_dir, tmp_path_factory)
    try:
        yield frontend
    finally:
        frontend.stop()
        engine.stop()


def chat(frontend: Frontend, model_id: str, prompt: str, max_tokens: int = MAX_TOKENS, **extra: object) -> str:
    return client_for(frontend).chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        **extra).choices[0].message.content


def spec_stats(frontend: Frontend) -> dict:
    stats = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
    assert stats["model_loads"] == 1
    return stats["speculative"]


def timed(frontend: Frontend, model_id: str) -> tuple[list[str], float]:
    started = time.perf_counter()
    texts = [chat(frontend, model_id, prompt, max_tokens=200, extra_body={"ignore_eos": True}) for prompt in PROMPTS]
    return texts, 3 * 200 / (time.perf_counter() - started)


def test_greedy_output_is_the_models_own(speculative: Frontend, model_id: str, references: dict[str, str]) -> None:
    before = spec_stats(speculative)
    assert before["draft_model"] and before["num_draft_tokens"] == 3 and before["active"] is True
    for prompt in PROMPTS:
        assert chat(speculative, model_id, prompt) == references[prompt]
    after = spec_stats(speculative)
    assert after["requests"] - before["requests"] == len(PROMPTS)  # each ran alone: all in the lane
    assert after["proposed"] > before["proposed"] and after["tokens"] > before["tokens"]
    assert after["acceptance_rate"] is not None and 0 <= after["acceptance_rate"] <= 1
    print(f"\n1-layer draft: acceptance {after['acceptance_rate']:.2f}, "
          f"{after['tokens_per_round']:.2f} tokens per model pass")


def test_draft_equal_to_the_model_accepts_every_token(self_draft: Frontend, frontend: Frontend, model_id: str,
                                                      references: dict[str, str]) -> None:
    """The upper bound of the mechanism; also tokens/s with and without a draft (tiny model, CPU)."""
    for prompt in PROMPTS:
        assert chat(self_draft, model_id, prompt) == references[prompt]
    stats = spec_stats(self_draft)
    assert stats["acceptance_rate"] >= 0.95, stats
    with_draft, speed_with = timed(self_draft, model_id)
    without_draft, speed_without = timed(frontend, model_id)  # the shared engine has no draft
    assert with_draft == without_draft
    stats = spec_stats(self_draft)
    print(f"\ndraft == model: acceptance {stats['acceptance_rate']:.2f}, {stats['tokens_per_round']:.2f} tokens "
          f"per model pass; {speed_with:.0f} tok/s with the draft vs {speed_without:.0f} without "
          "(the tiny model is overhead-bound: see bench/speculative.py for the realistic one)")


def test_others_arriving_move_the_lone_request_into_the_batch(speculative: Frontend, frontend: Frontend,
                                                              model_id: str, references: dict[str, str]) -> None:
    long_prompt = [{"role": "user", "content": "A long one, please."}]
    long_request = {"max_tokens": 1500, "temperature": 0, "extra_body": {"ignore_eos": True}}
    expected_long = client_for(frontend).chat.completions.create(  # the shared engine has no draft
        model=model_id, messages=long_prompt, **long_request).choices[0].message.content
    before = spec_stats(speculative)
    clients = [client_for(speculative) for _ in range(len(PROMPTS) + 1)]  # made before: creating one is slow
    results: dict[str, object] = {}
    first_token = threading.Event()

    def long_stream() -> None:
        parts = []
        for chunk in clients[-1].chat.completions.create(model=model_id, messages=long_prompt, stream=True,
                                                         **long_request):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                first_token.set()
        results["long"] = "".join(parts)
        results["long_done"] = time.monotonic()

    def short(i: int) -> str:
        return clients[i].chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=MAX_TOKENS,
            temperature=0).choices[0].message.content

    runner = threading.Thread(target=long_stream)
    runner.start()
    try:
        assert first_token.wait(30)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            shorts = list(pool.map(short, range(len(PROMPTS))))
        short_done = time.monotonic()
    finally:
        runner.join(60)
    assert shorts == [references[prompt] for prompt in PROMPTS]
    assert results["long"] == expected_long  # continued in the batch with its KV cache: the same tokens
    assert short_done < results["long_done"], "the newcomers should not wait for the lone request to finish"
    after = spec_stats(speculative)
    assert after["migrated_to_batch"] == before["migrated_to_batch"] + 1
    assert after["requests"] == before["requests"] + 1  # only the lone one started in the lane


def test_requests_the_lane_cannot_serve_use_the_batch(speculative: Frontend, model_id: str) -> None:
    before = spec_stats(speculative)["requests"]
    # A seeded sampled request (its key chain must match the batch's) and a grammar-constrained one.
    client_for(speculative).chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8, temperature=0.8, seed=7)
    client_for(speculative).chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8, temperature=0,
        response_format={"type": "json_object"})
    assert spec_stats(speculative)["requests"] == before


def test_incompatible_draft_is_refused_at_start(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """A draft whose token ids mean other strings could never be verified: engined exits 2 and says why."""
    other = tmp_path / "other-vocab"
    other.mkdir()
    for path in tiny_model.iterdir():
        if path.is_file() and path.name != "tokenizer.json":
            try:
                os.link(path, other / path.name)
            except OSError:
                shutil.copy2(path, other / path.name)
    tokenizer = json.loads((tiny_model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped: still a valid BPE
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    engine = Engine(f"ipc://{ipc_dir}/bad-draft.sock", tmp_path / "engined.log", model=str(tiny_model),
                    args=["--draft-model", str(other)])
    try:
        assert engine.popen.wait(60) == 2
    finally:
        engine.stop()
    log = engine.log()
    assert "cannot use --draft-model" in log and "tokenizers differ" in log, log
