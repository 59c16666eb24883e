"""Continuous batching through the real stack: exact outputs, seeds, aborts, prefix cache."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.helpers import Frontend, client_for

SHORT = "Hi."
LONG = " ".join(["Describe the history of the lighthouse and the sea around it in detail."] * 30)
PROMPTS = [SHORT, LONG, "What is two plus two?", "Name a color. " * 10, "Tell me about dogs and cats."]


def stats(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def complete(frontend: Frontend, model: str, prompt: str, max_tokens: int = 32, **extra) -> dict:
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(frontend: Frontend, model: str, prompt: str, max_tokens: int = 32, **extra) -> str:
    stream = client_for(frontend).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body=extra or None)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_batched_greedy_equals_alone_with_mixed_lengths_and_a_late_joiner(frontend: Frontend, model_id: str) -> None:
    alone = {p: complete(frontend, model_id, p, 48)["choices"][0]["message"]["content"] for p in PROMPTS}
    before = stats(frontend)["max_batch_size"]
    results: dict[str, str] = {}
    barrier = threading.Barrier(len(PROMPTS) - 1)

    def run(prompt: str, late: bool) -> None:
        if late:
            time.sleep(0.15)  # joins a batch that is already decoding
        else:
            barrier.wait()
        results[prompt] = stream_text(frontend, model_id, prompt, 48)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        list(pool.map(lambda ip: run(ip[1], ip[0] == len(PROMPTS) - 1), enumerate(PROMPTS)))
    assert results == alone
    assert stats(frontend)["max_batch_size"] >= max(before, 2), "requests never shared a decode step"


def test_seed_gives_the_same_output_alone_or_batched(frontend: Frontend, model_id: str) -> None:
    sampled = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
    alone = complete(frontend, model_id, PROMPTS[2], 32, **sampled)["choices"][0]["message"]["content"]
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(complete, frontend, model_id, p, 32, temperature=0.8) for p in PROMPTS[:3]]
        batched = pool.submit(complete, frontend, model_id, PROMPTS[2], 32, **sampled)
        greedy = pool.submit(complete, frontend, model_id, PROMPTS[0], 32)
        [f.result() for f in others]
    assert batched.result()["choices"][0]["message"]["content"] == alone
    # A greedy request sharing the batch with sampled ones is still exactly greedy.
    assert greedy.result()["choices"][0]["message"]["content"] == \
        complete(frontend, model_id, PROMPTS[0], 32)["choices"][0]["message"]["content"]


def test_abort_leaves_the_batch_and_the_others_continue(frontend: Frontend, model_id: str) -> None:
    expected = {p: complete(frontend, model_id, p, 64)["choices"][0]["message"]["content"] for p in PROMPTS[:2]}
    before = stats(frontend)
    got: dict[str, str] = {}
    threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, stream_text(frontend, model_id, p, 64)))
               for p in PROMPTS[:2]]
    for t in threads:
        t.start()
    body = {"model": model_id, "max_tokens": 3000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Go on and on."}]}
    with httpx.stream("POST", f"{frontend.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    for t in threads:
        t.join(60)
    assert got == expected
    deadline = time.monotonic() + 5
    while stats(frontend)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = stats(frontend)
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["running"] == 0 and after["queued"] == 0


def test_second_turn_reuses_the_prefix_cache(frontend: Frontend, model_id: str) -> None:
    history = [{"role": "system", "content": "You are a helpful assistant. " * 20},
               {"role": "user", "content": "Tell me a long story about a fox. " * 5}]
    client = client_for(frontend)
    first = client.chat.completions.create(model=model_id, messages=history, max_tokens=16, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=model_id, messages=history, max_tokens=16, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 2, (cached, first.usage.prompt_tokens)
    assert cached < second.usage.prompt_tokens
    s = stats(frontend)
    assert s["prompt_cache_hits"] >= 1 and s["prompt_cache_entries"] >= 1 and s["prompt_cache_bytes"] > 0
