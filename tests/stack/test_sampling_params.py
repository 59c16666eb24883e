"""logit_bias, penalties and top_k reach the sampler, per request, through the stack."""

from __future__ import annotations

import json

import httpx

from tests.helpers import Frontend

MESSAGES = [{"role": "user", "content": "Write a short poem about rivers."}]


def chat(frontend: Frontend, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **extra})


def test_logit_bias_forces_a_token(frontend: Frontend, model_id: str) -> None:
    from mlx_lm import load

    _, tokenizer = load(model_id)
    token = tokenizer.encode(" river", add_special_tokens=False)[0]
    r = chat(frontend, model_id, logit_bias={str(token): 100}, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    # (mlx-lm's streaming detokenizer drops the leading space of a reply)
    assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode([token] * 12).lstrip()
    # a ban works the other way round: the unbiased greedy text's first token disappears
    plain = chat(frontend, model_id).json()["choices"][0]["message"]["content"]
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = chat(frontend, model_id, logit_bias={str(first): -100}).json()["choices"][0]["message"]["content"]
    assert tokenizer.encode(banned, add_special_tokens=False)[0] != first


def test_penalties_change_greedy_output(frontend: Frontend, model_id: str) -> None:
    plain = chat(frontend, model_id, max_tokens=40, ignore_eos=True).json()["choices"][0]["message"]["content"]
    for field in ("presence_penalty", "frequency_penalty"):
        r = chat(frontend, model_id, max_tokens=40, ignore_eos=True, **{field: 2.0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] != plain


def test_bad_values_are_400_with_param(frontend: Frontend, model_id: str) -> None:
    for extra, param in (({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 500}}, "logit_bias"),
                         ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"presence_penalty": 3}, "presence_penalty"),
                         ({"frequency_penalty": "x"}, "frequency_penalty")):
        r = chat(frontend, model_id, **extra)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param


def test_min_tokens_holds_eos_back(frontend: Frontend, model_id: str) -> None:
    """vLLM's `min_tokens`: with EOS forced, the reply still runs that many tokens (it was silently ignored)."""
    from mlx_lm import load

    _, tokenizer = load(model_id)
    eos = {str(token): 100 for token in tokenizer.eos_token_ids}
    for min_tokens, expected in ((None, 0), (5, 5)):
        r = chat(frontend, model_id, logit_bias=eos, **({"min_tokens": min_tokens} if min_tokens else {}))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == expected, (min_tokens, r.json())
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    # A completed format outranks it: the reply ends with the grammar instead of sampling from nothing.
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "enum": ["yes"]}}}
    r = chat(frontend, model_id, min_tokens=10, response_format=schema)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == '"yes"', r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    for bad in (-1, 13, "5"):  # max_tokens is 12
        r = chat(frontend, model_id, min_tokens=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", (bad, r.text)


def test_a_top_k_past_the_vocabulary_keeps_every_token_and_hurts_no_one(frontend: Frontend, model_id: str) -> None:
    """mlx-lm's apply_top_k raised for such a top_k inside its compiled function, which left the global random
    key a placeholder: that request and the stream beside it failed with 500, then every sampled request after
    them ("Attempting to eval an array without a primitive") until a restart, while /health said healthy."""
    victim = {"model": model_id, "messages": MESSAGES, "max_tokens": 60, "temperature": 1.0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{frontend.base_url}/v1/chat/completions", json=victim, timeout=120) as stream:
        lines = stream.iter_lines()
        seen = [line for line, _ in zip(lines, range(3))]  # it runs: its first chunks came
        for top_k in (10**6, 2**31 - 1):
            r = chat(frontend, model_id, temperature=1.0, top_k=top_k)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
        seen += list(lines)
    chunks = [json.loads(line[6:]) for line in seen if line.startswith("data: {")]
    assert not [chunk for chunk in chunks if "error" in chunk], chunks[-1]
    assert chunks[-1]["usage"]["completion_tokens"] == 60
    for extra in ({"temperature": 1.0}, {"temperature": 0.7, "seed": 3}, {"temperature": 1.0, "top_k": 5}):
        r = chat(frontend, model_id, **extra)
        assert r.status_code == 200, (extra, r.text)
    anthropic = httpx.post(f"{frontend.base_url}/v1/messages", timeout=60, json={
        "model": model_id, "max_tokens": 4, "top_k": 1 << 20, "messages": [{"role": "user", "content": "Hi"}]})
    assert anthropic.status_code == 200, anthropic.text


def test_a_vanishing_temperature_is_greedy(frontend: Frontend, model_id: str) -> None:
    """1/temperature overflowed float32 below ~1e-38: every logit -inf, a uniform draw past every filter, bias and
    grammar mask (random text; a structured request 500 output_constraint_failed)."""
    greedy = chat(frontend, model_id, max_tokens=16, ignore_eos=True).json()["choices"][0]["message"]["content"]
    for temperature in (1e-300, 1e-39, 1e-6):
        r = chat(frontend, model_id, max_tokens=16, ignore_eos=True, temperature=temperature)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy, temperature
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = chat(frontend, model_id, max_tokens=40, temperature=1e-300,
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 200, r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"a"}
