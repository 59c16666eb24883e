"""/v1/embeddings through real processes: engined (chat model + embedding slot) + gunicorn + the openai SDK.

Two random-weight embedding models of real architectures: a BERT loaded by mlx-embeddings and a
Qwen3-Embedding-style decoder loaded by mlx-lm. Served vectors are compared with the packages'
own in-process output (mlx-embeddings' `text_embeds` for both: its qwen3 class pools the last
token as the engine does through mlx-lm). The chat model stays loaded throughout.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from model_builders.embedding import build_bert_embedding, build_decoder_embedding
from tests.helpers import call_engine, client_for, error_of, running_stack

TEXTS = ["The sea is blue today.", "hello world", "A much longer sentence about rivers, mountains and the city."]


@pytest.fixture(scope="module")
def models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-models")
    return {"bert": build_bert_embedding(root / "tiny-bert"), "decoder": build_decoder_embedding(root / "qwen3-embed"),
            "root": root}


@pytest.fixture(scope="module")
def stack(tiny_model: Path, models: dict[str, Path], ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator:
    ipc = ipc_dir
    args = ["--model-dir", str(models["root"]), "--embedding-model", str(models["bert"]), "--aux-step-tokens", "128"]
    with running_stack(f"ipc://{ipc}/emb.sock", tmp_path_factory.mktemp("logs"), model=str(tiny_model),
                       engine_args=args, env={"MLX_ENGINE_FAULT_INJECTION": "1"}) as (engine, frontend):
        yield engine, frontend


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return client_for(stack[1])


def stats(stack) -> dict:
    return httpx.get(f"{stack[1].base_url}/stats", timeout=10).json()


def reference(path: Path, texts: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    """The package's own vectors, in this process, one input at a time (no padding)."""
    import mlx.core as mx
    from mlx_embeddings import load

    model, tokenizer = load(str(path))
    ids = [tokenizer.encode(text) for text in texts]
    return np.stack([np.array(model(mx.array([row])).text_embeds[0]) for row in ids]), ids


def vectors(response) -> np.ndarray:
    return np.array([item.embedding for item in response.data], dtype=np.float32)


@pytest.mark.parametrize("kind", ["bert", "decoder"])
def test_vectors_equal_the_packages_own(client: openai.OpenAI, models: dict[str, Path], kind: str) -> None:
    expected, ids = reference(models[kind], TEXTS)
    name = models[kind].name
    batch = client.embeddings.create(model=name, input=TEXTS)
    assert batch.model in (name, str(models[kind])) and [item.index for item in batch.data] == [0, 1, 2]
    assert np.abs(vectors(batch) - expected).max() < 1e-5  # padded into one batch, same as alone
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(map(len, ids))
    single = client.embeddings.create(model=name, input=TEXTS[1])
    assert len(single.data) == 1 and np.abs(vectors(single)[0] - expected[1]).max() < 1e-5
    tokens = client.embeddings.create(model=name, input=ids[2])  # one token array
    assert np.abs(vectors(tokens)[0] - expected[2]).max() < 1e-5 and tokens.usage.prompt_tokens == len(ids[2])
    arrays = client.embeddings.create(model=name, input=ids)  # a list of token arrays
    assert np.abs(vectors(arrays) - expected).max() < 1e-5


def test_base64_is_the_float_vectors(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
    assert isinstance(floats.data[0].embedding[0], float)
    raw = client.with_raw_response.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="base64")
    body = raw.http_response.json()
    decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in body["data"]])
    assert np.array_equal(decoded, vectors(floats))
    sdk = client.embeddings.create(model="tiny-bert", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert np.array_equal(vectors(sdk), vectors(floats))


def test_dimensions_truncate_and_renormalize_where_the_model_allows(client: openai.OpenAI) -> None:
    full = vectors(client.embeddings.create(model="qwen3-embed", input=TEXTS))
    short = vectors(client.embeddings.create(model="qwen3-embed", input=TEXTS, dimensions=16))
    assert short.shape == (3, 16) and np.allclose(np.linalg.norm(short, axis=1), 1, atol=1e-5)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    assert np.abs(short - expected).max() < 1e-5
    with pytest.raises(openai.BadRequestError) as refused:  # a plain BERT was not trained for it
        client.embeddings.create(model="tiny-bert", input="hi", dimensions=16)
    assert refused.value.body["param"] == "dimensions" and refused.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="qwen3-embed", input="hi", dimensions=65)


def test_unknown_names_reach_the_configured_model(client: openai.OpenAI, models: dict[str, Path]) -> None:
    response = client.embeddings.create(model="text-embedding-3-small", input="hello world")
    assert response.model == str(models["bert"])
    listed = {m.id: m for m in client.models.list().data}
    assert listed[str(models["bert"])].type == "embedding"
    assert listed["qwen3-embed"].type == "embedding" and listed["tiny-bert"].type == "embedding"
    # `tiny-bert` under --model-dir is the slot's loaded directory: served without a load, so listed as loaded
    assert listed["tiny-bert"].loaded is True and listed["qwen3-embed"].loaded is False


def test_a_chat_request_for_an_embedding_model_is_refused_without_a_load(stack, client: openai.OpenAI) -> None:
    loads = stats(stack)["model_loads"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="qwen3-embed", messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in refused.value.body["message"] and stats(stack)["model_loads"] == loads


def test_without_an_embedding_model_unknown_names_are_404(frontend, model_id: str) -> None:
    """The session's shared engine has no --embedding-model: nothing to fall back to."""
    url = f"{frontend.base_url}/v1/embeddings"
    missing = httpx.post(url, json={"model": "text-embedding-3-small", "input": "hi"}, timeout=30)
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"
    chat = httpx.post(url, json={"model": model_id, "input": "hi"}, timeout=30)
    assert chat.status_code == 400 and "not a model of kind 'embedding'" in error_of(chat)["message"]
    unnamed = httpx.post(url, json={"input": "hi"}, timeout=30)
    assert unnamed.status_code == 400 and error_of(unnamed)["code"] == "model_required"


def test_langchain_openai_embeddings_unmodified(stack, client: openai.OpenAI) -> None:
    from langchain_openai import OpenAIEmbeddings

    # LangChain tokenizes with tiktoken by default and sends OpenAI token ids, which mean nothing to another
    # model (and tiktoken downloads its vocabulary): its documented setting for other servers sends the text.
    embeddings = OpenAIEmbeddings(model="tiny-bert", base_url=f"{stack[1].base_url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    documents = np.array(embeddings.embed_documents(TEXTS), dtype=np.float32)
    query = np.array(embeddings.embed_query(TEXTS[0]), dtype=np.float32)
    expected = vectors(client.embeddings.create(model="tiny-bert", input=TEXTS))
    assert np.abs(documents - expected).max() < 1e-6 and np.abs(query - expected[0]).max() < 1e-6


def test_litellm_embedding_unmodified(stack, client: openai.OpenAI) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list from GitHub
    litellm = pytest.importorskip("litellm")
    response = litellm.embedding(model="openai/tiny-bert", input=TEXTS, api_base=f"{stack[1].base_url}/v1",
                                 api_key="unused")
    served = np.array([item["embedding"] for item in response.data], dtype=np.float32)
    assert np.abs(served - vectors(client.embeddings.create(model="tiny-bert", input=TEXTS))).max() < 1e-6
    assert response.usage.prompt_tokens > 0


def test_bad_input_gets_clear_400s_and_the_engine_serves_on(stack, client: openai.OpenAI) -> None:
    url = f"{stack[1].base_url}/v1/embeddings"
    cases = {
        "empty list": {"model": "tiny-bert", "input": []},
        "empty string": {"model": "tiny-bert", "input": ""},
        "10 MB string": {"model": "tiny-bert", "input": "x" * 10_000_000},
        "too many tokens": {"model": "tiny-bert", "input": "sea " * 200},
        "mixed": {"model": "tiny-bert", "input": ["a", [1, 2]]},
        "token outside the vocabulary": {"model": "tiny-bert", "input": [[5, 10**6]]},
        "bad encoding_format": {"model": "tiny-bert", "input": "a", "encoding_format": "int8"},
        "no input": {"model": "tiny-bert"},
    }
    for case, body in cases.items():
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400, (case, response.text)
        error = error_of(response)
        assert error["type"] == "invalid_request_error" and error["param"] in ("input", "encoding_format"), case
    too_long = error_of(httpx.post(url, json=cases["too many tokens"], timeout=60))
    assert "maximum input length is 128 tokens" in too_long["message"]
    assert error_of(httpx.post(url, json=cases["10 MB string"], timeout=60))["code"] == "context_length_exceeded"
    assert len(client.embeddings.create(model="tiny-bert", input="still serving").data) == 1


def test_batches_are_shared_across_requests(stack, client: openai.OpenAI, models: dict[str, Path]) -> None:
    """Requests queued together share padded batches: the second's inputs fill the first's last slice.

    Token arrays of 20 tokens: a 128-token slice holds 6, so the first request's 199 inputs end in a
    slice with room for 5 of the other's (about 33 slices in: whichever is queued first is still
    running when the other joins; the mlx thread is held busy while both arrive).
    """
    import mlx.core as mx
    from mlx_embeddings import load

    rng = np.random.default_rng(0)
    docs = [rng.integers(5, 1000, size=(count, 20)).tolist() for count in (199, 199)]
    model, _ = load(str(models["bert"]))
    expected = [np.array(model(mx.array([doc[-1]])).text_embeds[0]) for doc in docs]
    before = stats(stack)["auxiliary_work"]["embedding"]["shared_batches"]
    hold = threading.Thread(target=call_engine, args=(stack[0].endpoint, "debug_sleep", {"seconds": 1.0}))
    hold.start()
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda inputs: client.embeddings.create(model="tiny-bert", input=inputs), docs))
    hold.join()
    for answer, vector in zip(answers, expected):
        assert len(answer.data) == 199 and np.abs(vectors(answer)[-1] - vector).max() < 1e-5
    assert stats(stack)["auxiliary_work"]["embedding"]["shared_batches"] > before


def test_chat_stream_runs_on_while_50_embedding_requests_are_served(stack, client: openai.OpenAI,
                                                                    tiny_model: Path) -> None:
    loads = stats(stack)["model_loads"]
    done_before = stats(stack)["auxiliary_jobs"].get("embedding_done", 0)
    stream = client.chat.completions.create(model=str(tiny_model), messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=300, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks: list = []
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: client.embeddings.create(model="tiny-bert", input=[f"doc {i}", TEXTS[0]]),
                                range(50)))
    reader.join(120)
    assert all(len(r.data) == 2 for r in results)
    after = stats(stack)
    assert after["model_loads"] == loads  # the chat model was never evicted or reloaded
    assert after["auxiliary_jobs"]["embedding_done"] - done_before == 50
    assert chunks[-1].usage.completion_tokens == 300  # the stream ran to its end, no error


def test_unload_frees_the_slot_and_the_next_request_loads_it_again(stack, client: openai.OpenAI) -> None:
    health = httpx.get(f"{stack[1].base_url}/health").json()
    assert [m["kind"] for m in health["auxiliary_models"]] == ["embedding"]
    before = stats(stack)
    unloaded = httpx.post(f"{stack[1].base_url}/unload", timeout=60).json()
    assert unloaded["status"] == "success" and len(unloaded["auxiliary_unloaded"]) == 1
    assert httpx.get(f"{stack[1].base_url}/health").json()["auxiliary_models"] == []
    client.embeddings.create(model="tiny-bert", input="back again")
    after = stats(stack)
    assert after["auxiliary_loads"] == before["auxiliary_loads"] + 1
    assert [m["name"] for m in after["auxiliary_models"]] == ["tiny-bert"]
