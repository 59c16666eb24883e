"""Chat logprobs in OpenAI's shape, streamed and not, through the openai SDK."""

from __future__ import annotations

import math
from pathlib import Path

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
        raw = bytes(entry.bytes)  # the token's own bytes: its text, or OpenAI's "bytes:\\xNN" when not UTF-8
        try:
            assert entry.token == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert entry.token == "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert joined.strip() == result.choices[0].message.content.strip()

    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # The same values to float rounding: the second request finds the first's prompt cached, so its first token's
    # logits come from a one-token pass where the first's came from the prompt's own (its last chunk's) pass.
    assert all(math.isclose(a.logprob, b.logprob, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(streamed, content))

    plain = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logprob_bytes_are_each_tokens_own_inside_a_character(frontend: Frontend, tiny_model: Path,
                                                              model_id: str) -> None:
    """ "é" as two byte tokens (0xC3, 0xA9): each entry carries its one byte, and the bytes join into the text."""
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(tiny_model)
    ids = tokenizer.encode("é", add_special_tokens=False)
    assert len(ids) == 2, ids  # the tiny vocabulary has no token for "é"
    client = client_for(frontend)
    for stream in (False, True):
        request = {"model": model_id, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True,
                   "logit_bias": {str(token): 100 for token in ids}}
        if stream:
            chunks = list(client.chat.completions.create(**request, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            result = client.chat.completions.create(**request)
            content, entries = result.choices[0].message.content, result.choices[0].logprobs.content
        assert len(entries) == 4 and all(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for e in entries), entries
        assert all(e.token == f"bytes:\\x{e.bytes[0]:02x}" for e in entries)
        assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == content


def test_top_logprobs_needs_logprobs(frontend: Frontend, model_id: str) -> None:
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30, json={
        "model": model_id, "messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30, json={
        "model": model_id, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
