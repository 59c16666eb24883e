"""Prefix sharing between requests that run at once (`PrefillSharing`), through real processes.

A prompt's KV joins the prefix cache the step its prefill ends, so a request sent while
another with the same long prefix is still decoding reuses it; requests that arrive
together share one prefill of their common prefix. Greedy answers are exactly those of
the same request sent alone. Assertions read what the engine reports (usage, /stats).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import Frontend, client_for, running_stack

# Several hundred tokens with the tiny tokenizer: above `MIN_SHARED_TOKENS`.
SHARED = ("You are the release engineer of a large project. Follow the checklist: tag, build, sign, "
          "publish, announce, and watch the dashboards for one hour. ") * 24


def stats(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def ask(frontend: Frontend, model_id: str, question: str, **extra: object):
    return client_for(frontend).chat.completions.create(
        model=model_id, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": SHARED}, {"role": "user", "content": question}], **extra)


def test_a_prompt_is_shared_while_its_request_still_decodes(frontend: Frontend, model_id: str) -> None:
    system = "Changelog duty. " + SHARED  # no earlier test's entry shares it: only the running request's can
    before = stats(frontend)
    long_running = client_for(frontend).chat.completions.create(
        model=model_id, temperature=0, max_tokens=3000, stream=True, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Write the changelog."}])
    try:
        next(iter(long_running))  # its prefill is done: it decodes from here on
        started = stats(frontend)
        reply = client_for(frontend).chat.completions.create(
            model=model_id, temperature=0, max_tokens=8,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": "Which step comes after sign?"}])
        during = stats(frontend)
        assert during["running"] >= 1  # the first request is still decoding: no finished request taught the cache
    finally:
        long_running.close()
    shared_tokens = reply.usage.prompt_tokens - 20  # everything but the user turn's own tokens, roughly
    assert reply.usage.prompt_tokens_details.cached_tokens >= shared_tokens
    assert during["prefix_published_at_prefill"] > before["prefix_published_at_prefill"]
    # The hit is counted in the in-flight tier (the entry's publisher still ran), not as a plain memory hit.
    assert during["prompt_cache_in_flight_hits"] == started["prompt_cache_in_flight_hits"] + 1
    assert during["prompt_cache_memory_hits"] == started["prompt_cache_memory_hits"]
    metrics = httpx.get(f"{frontend.base_url}/metrics", timeout=30).text
    assert f'tier="in_flight"}} {during["prompt_cache_in_flight_hits"]}' in metrics


@pytest.fixture(scope="module")
def cold(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    """The same model with no prefix cache at all: every prompt prefilled from scratch (the reference)."""
    with running_stack(f"ipc://{ipc_dir}/cold.sock", tmp_path_factory.mktemp("cold"), model=str(tiny_model),
                       engine_args=["--prompt-cache-size", "0"]) as (_, frontend):
        yield frontend


def test_requests_arriving_together_prefill_their_shared_prefix_once(frontend: Frontend, cold: Frontend,
                                                                    model_id: str) -> None:
    # A system prompt no cache holds yet, then four questions sent at once.
    system = "Another project, another checklist. " * 6 + SHARED
    questions = [f"Question {i}: what is step {i} of the checklist, and who owns it?" for i in range(4)]
    before = stats(frontend)

    def send(target: Frontend, question: str):
        return client_for(target).chat.completions.create(
            model=model_id, temperature=0, max_tokens=8,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])

    with ThreadPoolExecutor(len(questions)) as pool:
        replies = list(pool.map(lambda q: send(frontend, q), questions))
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    # One of them prefilled the shared system prompt; every other one took it from the cache.
    assert cached[0] < 256 and all(c >= replies[0].usage.prompt_tokens - 40 for c in cached[1:]), cached
    after = stats(frontend)
    assert after["prefix_published_at_prefill"] > before["prefix_published_at_prefill"]
    # Greedy answers do not depend on where the prefix came from: each equals a cold prefill's.
    for question, reply in zip(questions, replies):
        reference = send(cold, question)
        assert reference.usage.prompt_tokens_details.cached_tokens == 0
        assert reply.choices[0].message.content == reference.choices[0].message.content
