"""Chat logprobs in OpenAI's shape, streamed and not, through the openai SDK."""

from __future__ import annotations

import math

import httpx

from tests.helpers import Frontend, client_for

MESSAGES = [{"role": "user", "content": "Name three colors."}]


def test_logprobs_shape_and_agreement(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    result = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content).strip() == result.choices[0].message.content.strip()

    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # The same values to float rounding: the second request finds the first's prompt cached, so its first token's
    # logits come from a one-token pass where the first's came from the prompt's own (its last chunk's) pass.
    assert all(math.isclose(a.logprob, b.logprob, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(streamed, content))

    plain = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None


def test_top_logprobs_needs_logprobs(frontend: Frontend, model_id: str) -> None:
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30, json={
        "model": model_id, "messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30, json={
        "model": model_id, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
