"""Raw-prompt completions and (de)tokenization through the real stack: openai SDK / httpx -> gunicorn -> engined."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.helpers import Frontend, client_for, error_of

PROMPT = "Once upon a time, a fox"


def test_completion_stream_and_non_stream_agree_and_equal_mlx_lm(frontend: Frontend, tiny_model: Path,
                                                                 model_id: str) -> None:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    client = client_for(frontend)
    result = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0)
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    choice = result.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert result.usage.prompt_tokens > 0 and result.usage.completion_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens

    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert len({c.id for c in chunks}) == 1

    # Raw text, no chat template: the same as mlx_lm on the same string, with the model's shipped defaults.
    model, tokenizer = load(str(tiny_model))
    shipped = json.loads((tiny_model / "generation_config.json").read_text())
    processors = make_logits_processors(repetition_penalty=shipped.get("repetition_penalty"))
    generated = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=24,
                                                  logits_processors=processors)]
    # The text continues the prompt: a first token's leading space stays (mlx-lm's streaming text trims it).
    expected = tokenizer.decode([t for t in generated if t not in tokenizer.eos_token_ids])
    assert choice.text == expected

    # Token ids are taken as they are: the tokenized prompt gives the same text.
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == expected
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completion_logprobs_in_the_legacy_shape_and_echo(frontend: Frontend, tiny_model: Path, model_id: str) -> None:
    """Greedy: each token's logprob is the top one of its alternatives; the tokens spell the text; `echo` puts the
    prompt (token ids read back by the engine's tokenizer) before the same completion."""
    from mlx_lm.tokenizer_utils import load

    client = client_for(frontend)
    result = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    choice, logprobs = result.choices[0], result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == result.usage.completion_tokens
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0 and top[token] == logprob == max(top.values())
    streamed = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0,
                                              logprobs=3, stream=True))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens

    ids = load(tiny_model).encode(PROMPT)
    read_back = httpx.post(f"{frontend.base_url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    echoed = client.completions.create(model=model_id, prompt=ids, max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == read_back + choice.text
    streamed = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0, echo=True,
                                              stream=True))
    assert streamed[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + choice.text


def test_completion_keeps_the_first_tokens_leading_space(frontend: Frontend, tiny_model: Path, model_id: str) -> None:
    """ "Once upon a time" + "Ġthere": the client's prompt + text must read "Once upon a time there"."""
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(tiny_model)
    (spaced,) = tokenizer.encode(" week", add_special_tokens=False)
    client = client_for(frontend)
    request = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0,
               "logit_bias": {str(spaced): 100}}
    assert client.completions.create(**request).choices[0].text == " week week"
    assert "".join(c.choices[0].text for c in client.completions.create(**request, stream=True)) == " week week"
    # A stop string that is that very space ends the text before it, at the first token.
    stopped = client.completions.create(**{**request, "stop": [" "]})
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"


def test_completion_default_max_tokens_and_alias(frontend: Frontend, model_id: str) -> None:
    with httpx.Client(base_url=frontend.base_url, timeout=60) as http:
        r = http.post("/completions", json={"model": model_id, "prompt": PROMPT, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] == 16  # OpenAI's default for completions
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": body["usage"]["prompt_tokens_details"]
                                                          ["cached_tokens"]}


def test_include_usage_ends_with_a_usage_chunk(frontend: Frontend, model_id: str) -> None:
    chunks = list(client_for(frontend).completions.create(
        model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 8 or chunks[-2].choices[0].finish_reason == "stop"
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_sse_framing_ends_with_done(frontend: Frontend, model_id: str) -> None:
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{frontend.base_url}/v1/completions",
                         json={"model": model_id, "prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    first = json.loads(data[0])
    assert first["object"] == "text_completion" and set(first["choices"][0]) == {"index", "text", "logprobs",
                                                                                 "finish_reason"}


def test_unsupported_and_invalid_fields_get_400_naming_the_param(frontend: Frontend, model_id: str) -> None:
    url = f"{frontend.base_url}/v1/completions"
    cases = [
        ({"max_tokens": 0}, "max_tokens"),  # 0 only when scoring the prompt (`echo` with `logprobs`)
        ({"suffix": "end"}, "suffix"),
        ({"n": 17}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": ["one", 2]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, "x"]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [-1, 2]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),  # outside the vocabulary: the engine refuses it
        ({"prompt": [1] * 40_000}, "prompt"),  # past the tiny model's 32768-token context window
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"temperature": True}, "temperature"),
    ]
    with httpx.Client(timeout=30) as http:
        r = http.post(url, json={"model": model_id})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt"
        for extra, param in cases:
            r = http.post(url, json={"model": model_id, "prompt": PROMPT, "max_tokens": 4, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert error_of(r)["param"] == param, (extra, r.text)
        # Accepted no-ops and unknown fields.
        r = http.post(url, json={"model": model_id, "prompt": [PROMPT], "max_tokens": 2, "echo": False,
                                 "suffix": None, "n": 1, "best_of": 1, "some_future_field": {"x": 1}})
        assert r.status_code == 200, r.text


def test_tokenize_detokenize_round_trip(frontend: Frontend, tiny_model: Path, model_id: str) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    with httpx.Client(base_url=frontend.base_url, timeout=30) as http:
        r = http.post("/v1/tokenize", json={"model": model_id, "prompt": PROMPT})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) > 0
        assert body["max_model_len"] == config["max_position_embeddings"]
        r = http.post("/detokenize", json={"model": model_id, "tokens": body["tokens"]})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": PROMPT}

        # The same count as a completion's usage.
        usage = http.post("/v1/completions", json={"model": model_id, "prompt": PROMPT, "max_tokens": 1}).json()
        assert usage["usage"]["prompt_tokens"] == body["count"]

        # Messages go through the chat template (with the generation prompt): more tokens than the bare text.
        r = http.post("/tokenize", json={"messages": [{"role": "user", "content": PROMPT}]})
        assert r.status_code == 200, r.text
        assert r.json()["count"] > body["count"]
        chat = http.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 1,
                                                       "messages": [{"role": "user", "content": PROMPT}]}).json()
        assert chat["usage"]["prompt_tokens"] == r.json()["count"]


def test_tokenize_errors(frontend: Frontend, model_id: str) -> None:
    with httpx.Client(base_url=frontend.base_url, timeout=30) as http:
        r = http.post("/v1/detokenize", json={"tokens": [1, 10**9]})
        assert r.status_code == 400 and error_of(r)["param"] == "tokens"
        r = http.post("/v1/detokenize", json={"tokens": ["a"]})
        assert r.status_code == 400 and error_of(r)["param"] == "tokens"
        r = http.post("/v1/detokenize", json={})
        assert r.status_code == 400 and error_of(r)["param"] == "tokens"
        r = http.post("/v1/tokenize", json={})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt"
        r = http.post("/v1/tokenize", json={"prompt": 3})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt"
        r = http.post("/v1/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt"
        r = http.post("/v1/tokenize", json={"messages": [{"role": "wizard", "content": "x"}]})
        assert r.status_code == 400 and "role" in error_of(r)["param"]
        r = http.post("/v1/tokenize", json={"model": "some-other/model", "prompt": "x"})  # as generation: unknown
        assert r.status_code == 404 and error_of(r)["param"] == "model"


def test_tokenize_without_a_loaded_model_is_a_clear_400(ipc_dir: Path, tmp_path: Path) -> None:
    """Tokenizing never loads a model (it would evict the serving one): with none loaded it is refused."""
    import zmq

    from protocol import MsgType, decode, encode
    from tests.helpers import Engine

    engine = Engine(f"ipc://{ipc_dir}/no-model.sock", tmp_path / "engined.log")
    try:
        engine.wait_ready(model_loaded=False)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine.endpoint)
        try:
            sock.send(encode(MsgType.CALL, {"cid": "c1", "method": "tokenize", "args": {"prompt": "hi"}}))
            assert sock.poll(30_000)
            msg_type, body = decode(sock.recv())
        finally:
            sock.close()
        assert msg_type == MsgType.ERROR
        assert body["cid"] == "c1" and body["status"] == 400 and body["code"] == "model_not_loaded"
        assert "No model is loaded" in body["message"]
    finally:
        engine.stop()


def test_an_array_of_prompts_gets_each_prompts_own_completions(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    prompts = [PROMPT, "The river runs down to the sea and", "Numbers: one two three"]
    alone = [client.completions.create(model=model_id, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = client.completions.create(model=model_id, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=model_id, prompt=prompts, max_tokens=6, temperature=0,
                                           stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}
