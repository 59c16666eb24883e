"""Chat completions through the real stack: openai SDK -> gunicorn (2 workers) -> engined -> MLX."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Frontend, client_for, error_of

PROMPTS = [
    "Tell me a story about a fox.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child.",
    "Why is the sky blue?",
    "Give me a recipe for bread.",
    "Count from one to ten.",
]


def chat(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 24) -> str:
    result = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0)
    return result.choices[0].message.content


def chat_streamed(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 24) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_non_streaming_and_streaming_agree(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    result = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=24, temperature=0)
    assert result.object == "chat.completion"
    assert result.choices[0].finish_reason in ("stop", "length")
    assert result.usage.completion_tokens > 0 and result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    text = result.choices[0].message.content
    assert text

    streamed, chunks = chat_streamed(client, model_id, PROMPTS[0])
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == result.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == result.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_greedy_output_equals_mlx_lm_generate(frontend: Frontend, tiny_model: Path, model_id: str) -> None:
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = load(str(tiny_model))
    # The server applies the model's shipped generation_config.json defaults; so does this reference.
    shipped = json.loads((tiny_model / "generation_config.json").read_text())
    processors = make_logits_processors(repetition_penalty=shipped.get("repetition_penalty"))
    for prompt in PROMPTS[:3]:
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        expected = generate(model, tokenizer, tokens, max_tokens=40, logits_processors=processors)
        served = client_for(frontend).chat.completions.create(
            model=model_id, messages=messages, max_tokens=40, temperature=0).choices[0].message.content
        assert served == expected


def test_concurrent_streams_each_get_their_own_text(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    expected = [chat(client, model_id, p) for p in PROMPTS]
    assert len(set(expected)) > 1, "prompts should give distinct outputs for this test to mean anything"
    start = threading.Barrier(len(PROMPTS))

    def run(prompt: str) -> str:
        own = client_for(frontend)  # one client per thread, spread over both workers
        start.wait()
        return chat_streamed(own, model_id, prompt)[0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(run, PROMPTS))
    assert got == expected


def test_bad_input_gets_openai_errors_without_disturbing_a_good_request(frontend: Frontend, model_id: str) -> None:
    url = f"{frontend.base_url}/v1/chat/completions"
    good_text: list[str] = []
    good = threading.Thread(target=lambda: good_text.append(
        chat_streamed(client_for(frontend), model_id, PROMPTS[1], max_tokens=64)[0]))
    good.start()
    with httpx.Client(timeout=30) as http:
        r = http.post(url, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
        r = http.post(url, json={"model": model_id})
        assert r.status_code == 400 and error_of(r)["param"] == "messages"
        r = http.post(url, json={"model": model_id, "messages": "hi"})
        assert r.status_code == 400 and error_of(r)["param"] == "messages"
        r = http.post(url, json={"model": model_id, "messages": [{"role": "user", "content": "x"}],
                                 "max_tokens": "ten"})
        assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
        r = http.post(url, json={"model": model_id, "messages": [{"role": "user", "content": "x"}],
                                 "temperature": True})
        assert r.status_code == 400 and error_of(r)["param"] == "temperature"
        r = http.post(url, json={"model": model_id, "messages": [{"role": "wizard", "content": "x"}]})
        assert r.status_code == 400 and "role" in error_of(r)["param"]
        r = http.post(url, json={"model": model_id, "messages": [{"role": "user", "content": "x"}], "n": 17})
        assert r.status_code == 400 and error_of(r)["param"] == "n"
        r = http.post(url, json={"model": "no-such-org/no-such-model",
                                 "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
        assert model_id in error_of(r)["message"]  # the loaded model (started by path) is named for the client
        r = http.post(url, json={"model": model_id, "messages": [{"role": "user", "content": "word " * 40_000}],
                                 "max_tokens": 4})  # the prompt alone is past the 32768-token window
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
        r = http.get(f"{frontend.base_url}/v1/no/such/route")
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"
        r = http.get(url)
        assert r.status_code == 405
        error_of(r)
    with pytest.raises(openai.NotFoundError) as info:
        client_for(frontend).chat.completions.create(model="no-such-org/no-such-model",
                                                     messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    good.join(60)
    assert good_text and good_text[0] == chat(client_for(frontend), model_id, PROMPTS[1], max_tokens=64)


def test_routes_answer_without_v1_prefix(frontend: Frontend, model_id: str) -> None:
    with httpx.Client(base_url=frontend.base_url, timeout=30) as http:
        r = http.post("/chat/completions", json={"model": model_id, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        assert http.get("/models").json()["object"] == "list"


def test_stop_string_ends_the_text_before_it(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    full = chat(client, model_id, PROMPTS[2], max_tokens=40)
    stop = full[10:13]
    assert len(stop) == 3
    cut = full[: full.index(stop)]
    result = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPTS[2]}],
                                            max_tokens=40, temperature=0, stop=[stop])
    assert result.choices[0].message.content == cut
    assert result.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=40, temperature=0,
        stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_string_straddling_two_tokens_is_never_partially_streamed(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    messages = [{"role": "user", "content": PROMPTS[4]}]
    full = client.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=0,
                                          logprobs=True)
    tokens = [entry.token for entry in full.choices[0].logprobs.content]
    # The first boundary with at least two characters on each side: the stop string spans it.
    at = next(i for i in range(5, len(tokens) - 1) if len(tokens[i]) >= 2 and len(tokens[i + 1]) >= 2)
    stop = tokens[at][-2:] + tokens[at + 1][:2]
    text = full.choices[0].message.content
    cut = text[: text.index(stop)]
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=0,
                                                 stop=[stop], stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == cut  # not one character of the stop string went out
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_seed_makes_sampling_reproducible(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)

    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=24,
            temperature=1.0, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_n_choices_stream_and_non_stream_agree(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    args = {"model": model_id, "messages": [{"role": "user", "content": PROMPTS[5]}], "max_tokens": 8,
            "temperature": 1.0, "seed": 11, "n": 3}
    result = client.chat.completions.create(**args)
    assert [c.index for c in result.choices] == [0, 1, 2]
    texts = [c.message.content for c in result.choices]
    assert len(set(texts)) > 1  # seeds seed+i: the choices differ
    single = client.chat.completions.create(**{**args, "n": 1})
    assert result.usage.prompt_tokens == single.usage.prompt_tokens
    assert 3 <= result.usage.completion_tokens <= 3 * 8  # summed over the choices, prompt counted once

    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    streamed = ["", "", ""]
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == texts
    assert set(finishes) == {0, 1, 2}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == result.usage.completion_tokens
    assert sum(1 for c in chunks if not c.choices) == 1  # one usage chunk for all choices
