"""Each embedding family through the engine's loader and shared padded batches, against the package alone.

In process, no engine: the random-weight builders (`model_builders.embedding`) make a BERT, an
XLM-RoBERTa, a ModernBERT (inputs longer than its sliding window) and a Qwen3-Embedding-style
decoder; inputs of different lengths go through one `EmbeddingJob` (right-padded together, as the
engine batches them) and must equal mlx-embeddings' own `text_embeds` of each input alone.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine_daemon.auxiliary.embedding import load_embedding_model, pooling_of
from engine_daemon.auxiliary.embedding_job import EmbeddingJob
from engine_daemon.errors import RequestError
from model_builders.embedding import build_bert_embedding, build_decoder_embedding

TEXTS = ["hello world", "The sea is blue today and the rivers run through the mountains and the city at night"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("embedders")


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "modernbert", "decoder"])
def test_padded_batches_equal_the_package_alone(root: Path, arch: str) -> None:
    from mlx_embeddings import load

    path = (build_decoder_embedding(root / "qwen3-embed") if arch == "decoder"
            else build_bert_embedding(root / arch, arch=arch))
    assert pooling_of(path) == ("decoder" if arch == "decoder" else "encoder")
    model = load_embedding_model(arch, str(path))
    reference, tokenizer = load(str(path))
    ids = [tokenizer.encode(text) for text in TEXTS]
    expected = np.stack([np.array(reference(mx.array([row])).text_embeds[0]) for row in ids])
    job = EmbeddingJob(model, TEXTS, None)
    job.prepare()
    job.queued()
    while not job.step(4096):
        pass
    assert np.abs(np.stack(job.vectors) - expected).max() < 1e-5
    assert job.prompt_tokens == sum(map(len, ids)) and len(ids[1]) > 8  # past ModernBERT's window of 8


def test_a_long_decoder_input_runs_in_chunks_with_the_same_vector(root: Path) -> None:
    path = build_decoder_embedding(root / "qwen3-embed")
    model = load_embedding_model("qwen3-embed", str(path))
    text = " ".join(["rivers and mountains"] * 30)
    whole, chunked = EmbeddingJob(model, [text], None), EmbeddingJob(model, [text], None)
    whole.prepare()
    whole.queued()
    assert len(whole.tokens[0]) > 64
    while not whole.step(4096):
        pass
    chunked.prepare()
    chunked.queued()  # queued alone: otherwise it would share the first job's batch
    slices = 0
    while not chunked.step(16):  # 16-token slices: a KV cache carries the input across them
        slices += 1
    assert slices >= len(chunked.tokens[0]) // 16 - 1
    assert np.abs(chunked.vectors[0] - whole.vectors[0]).max() < 1e-5


def test_inputs_over_the_limit_are_refused_before_or_after_tokenizing(root: Path) -> None:
    model = load_embedding_model("bert", str(build_bert_embedding(root / "bert")))
    with pytest.raises(RequestError) as by_size:
        EmbeddingJob(model, ["x" * 10_000_000], None).prepare()
    assert by_size.value.code == "context_length_exceeded" and "bytes" in str(by_size.value)
    with pytest.raises(RequestError) as by_tokens:
        EmbeddingJob(model, ["sea " * 200], None).prepare()
    assert "has 202 tokens" in str(by_tokens.value)


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_layer_slices_equal_one_forward_pass(root: Path, arch: str) -> None:
    """A batch carried across ticks layer by layer gives the vectors of the unsliced forward pass."""
    path = build_bert_embedding(root / arch, arch=arch)
    sliced, whole = load_embedding_model(arch, str(path)), load_embedding_model(arch, str(path))
    whole.layer_slicing = False
    layers = len(sliced.model.encoder.layer)
    assert layers >= 2
    vectors = {}
    for name, model in (("sliced", sliced), ("whole", whole)):
        job = EmbeddingJob(model, TEXTS, None)
        job.prepare()
        job.queued()
        steps = 1
        while not job.step(1):  # a 1-token budget: one encoder layer per slice
            steps += 1
        vectors[name] = np.stack(job.vectors)
        if name == "sliced":
            # each input alone (budget 1 batches one input), one layer per slice
            assert steps == len(TEXTS) * layers
            assert model.counts["layer_slices"] == steps and model.counts["batches"] == len(TEXTS)
        else:
            assert steps == len(TEXTS) and model.counts["layer_slices"] == 0
    assert np.abs(vectors["sliced"] - vectors["whole"]).max() < 1e-5


def test_a_layer_slice_holds_as_many_layers_as_the_budget_prices(root: Path) -> None:
    model = load_embedding_model("bert", str(build_bert_embedding(root / "bert")))
    layers = len(model.model.encoder.layer)
    job = EmbeddingJob(model, TEXTS[1:], None)
    job.prepare()
    job.queued()
    tokens = len(job.tokens[0])
    # a layer of an n-token batch costs n / layers tokens of a whole pass: that budget buys one layer
    assert job.step(tokens // layers) is False and model.layered.layer == 1
    assert job.last_slice_tokens == tokens // layers
    assert job.step(tokens * layers) is True and model.layered is None  # the other layers and the pooling
    assert job.last_slice_tokens == tokens * (layers - 1) // layers


def test_a_batch_is_refused_after_the_slice_holding_its_first_long_input() -> None:
    """Red team: 2,048 inputs were all tokenized before input[0] was refused (21-29 s a request)."""
    from types import SimpleNamespace

    from engine_daemon.auxiliary.embedding_job import TOKENIZE_SLICE, EmbeddingJob
    from engine_daemon.errors import RequestError

    tokenized: list[int] = []

    def tokenizer(texts: list[str], add_special_tokens: bool) -> dict[str, list[list[int]]]:
        tokenized.append(len(texts))
        return {"input_ids": [[1] * len(text) for text in texts]}

    model = SimpleNamespace(tokenizer=tokenizer, max_tokens=8, vocab_size=100, dimensions=4, name="m",
                            longest_token_bytes=lambda: 4)
    job = EmbeddingJob(model, ["x" * 20] + ["ok"] * (4 * TOKENIZE_SLICE), None)
    try:
        job.prepare()
    except RequestError as exc:
        assert exc.code == "context_length_exceeded" and "input[0]" in str(exc)
    else:
        raise AssertionError("an input of 20 tokens passed a limit of 8")
    assert tokenized == [TOKENIZE_SLICE]
    fine = EmbeddingJob(model, ["ok"] * (2 * TOKENIZE_SLICE + 3), None)
    fine.prepare()
    assert len(fine.tokens) == 2 * TOKENIZE_SLICE + 3
