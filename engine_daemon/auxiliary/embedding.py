"""Embedding models in the embedding slot: encoders through mlx-embeddings, decoders through mlx-lm.

Two well-kept paths, each the package's own:

* Encoders (BERT, XLM-RoBERTa, ModernBERT… every `model_type` mlx-embeddings ships):
  `mlx_embeddings.load`, and the model's own `text_embeds` (mean pooling over the attention
  mask, then L2 normalization, as the package computes it). Two exceptions: a model whose
  sentence-transformers config pools the [CLS] token (BGE) gets its [CLS] state, as
  sentence-transformers computes it, and a checkpoint the package leaves unpooled (ModernBERT
  saved as a masked LM) is mean-pooled over the mask here.
* Decoder embedding models (Qwen3-Embedding style): `mlx_lm.load` (every architecture
  mlx-lm has), the final-norm hidden state of the last token, L2-normalized. A decoder
  directory counts as an embedding model when its sentence-transformers pooling config says
  `pooling_mode_lasttoken` (as Qwen3-Embedding ships), or its name says "embed".

Inputs of one batch are right-padded: encoders mask the padding out of attention and pooling,
and a causal decoder never looks at later positions, so a padded batch gives each input the
vectors it gets alone. A decoder input longer than a slice's budget is run in chunks through a
KV cache, so no slice is longer than `--aux-step-tokens` tokens. Work is shared across requests:
every queued job's inputs wait in one `pending` queue per model and each slice takes from its head.

BERT and XLM-RoBERTa encoders (the package's `bert` and `xlm_roberta` models) run a batch in layer
slices (`LayerSliced`): as many encoder layers per slice as the budget holds (one layer of an
n-token batch counts as n / layers tokens of work, so the queue's per-token measure prices a
layer), the embeddings layer in the first slice and pooling and normalization in the last; the hidden state and the
attention mask wait between slices, evaluated (`mx.eval`) at each slice's end so the work happens
in that slice. Each step calls the package's own modules with the arguments its `Model.__call__`
gives them, so the vectors equal the package's. ModernBERT (its layers take a global and a
sliding-window mask its model builds, and its checkpoints carry different heads: not layer-sliced
yet) keeps a whole forward pass per slice; a decoder keeps its KV-cache chunks.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from engine_daemon.auxiliary.embedding_job import EmbeddingJob, Sequence
from engine_daemon.auxiliary.model import register_loader
from engine_daemon.models.store import is_embedding_architecture

log = logging.getLogger(__name__)

# model_types whose position table is offset by the padding index (RoBERTa's layout): 2 positions fewer
_OFFSET_POSITIONS = {"xlm-roberta", "xlm_roberta", "roberta"}
# mlx-embeddings modules whose forward pass `LayerSliced` runs layer by layer
_LAYERED_MODULES = {"mlx_embeddings.models.bert": "bert", "mlx_embeddings.models.xlm_roberta": "xlm_roberta"}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _mlx_lm_has(model_type: str) -> bool:
    return importlib.util.find_spec(f"mlx_lm.models.{model_type.replace('-', '_')}") is not None


def pooling_of(path: Path) -> str | None:
    """"encoder", "decoder" or None (not an embedding model), from the directory's files alone."""
    config = _read_json(path / "config.json")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    pooling = _read_json(path / "1_Pooling" / "config.json")
    if pooling.get("pooling_mode_lasttoken") and _mlx_lm_has(model_type):
        return "decoder"
    if _mlx_lm_has(model_type):
        named = "embed" in path.name.lower() or "embed" in str(config.get("_name_or_path", "")).lower()
        return "decoder" if named and not pooling else None
    return "encoder" if is_embedding_architecture(model_type) else None


@dataclass
class _Chunked:
    """A decoder input longer than a slice: run chunk by chunk through a KV cache."""

    sequence: Sequence
    cache: list[Any]
    done: int = 0


@dataclass
class LayerSliced:
    """An encoder batch between slices: its hidden state, its masks and the next layer to run.

    `layer` is -1 before the embeddings layer has run, else the next encoder layer to run.
    """

    batch: list[Sequence]
    longest: int
    ids: mx.array
    attention: mx.array  # (batch, longest) 1/0: pooling's mask
    hidden: mx.array | None = None
    extended: mx.array | None = None  # the additive attention mask the layers take
    layer: int = -1


def layered_family(model: Any) -> str | None:
    """"bert" / "xlm_roberta" when `model` is one of the package's encoders `LayerSliced` can run, else None."""
    return _LAYERED_MODULES.get(type(model).__module__)


@dataclass
class EmbeddingModel:
    """The loaded embedding model: its MLX model, tokenizer, pooling and the inputs waiting for it."""

    name: str
    path: str
    model: Any
    tokenizer: Any  # the Hugging Face tokenizer (thread-safe encode: jobs tokenize on the admission pool)
    pooling: str  # "encoder" | "decoder"
    max_tokens: int
    dimensions: int
    matryoshka: bool  # `dimensions` (truncate + renormalize) is allowed
    vocab_size: int
    cls_pooling: bool = False  # encoders: 1_Pooling says pooling_mode_cls_token (else the package's mean pooling)
    weight_bytes: int = 0
    kind: str = "embedding"
    profile: Any = None  # the --models-config profile of its name (`AuxiliarySlots` sets it)
    pending: deque[Sequence] = field(default_factory=deque)
    chunked: _Chunked | None = None
    layered: LayerSliced | None = None
    layer_slicing: bool = True  # BERT / XLM-R encoders: batches in layer slices (False: a forward pass per slice)
    closed: bool = False
    counts: dict[str, int] = field(default_factory=lambda: {"batches": 0, "inputs": 0, "tokens": 0,
                                                             "shared_batches": 0, "layer_slices": 0})
    _longest_token: int = 0

    def close(self) -> None:
        self.closed = True
        self.pending.clear()
        self.chunked = None
        self.layered = None
        self.model = None
        gc.collect()

    def supports_dimensions(self) -> bool:
        """`dimensions` allowed: the operator's `embedding_dimensions`, else the model's own declaration."""
        override = getattr(self.profile, "embedding_dimensions", None)
        return self.matryoshka if override is None else bool(override)

    def longest_token_bytes(self) -> int:
        """Bytes of the vocabulary's longest token (at least 8): bounds an input's bytes by its token limit."""
        if not self._longest_token:
            try:
                longest = max((len(t.encode("utf-8", "surrogatepass")) for t in self.tokenizer.get_vocab()), default=0)
            except Exception:
                longest = 0
            self._longest_token = max(longest, 8)
        return self._longest_token

    def job(self, args: dict[str, Any]) -> EmbeddingJob:
        return EmbeddingJob(self, args["input"], args.get("dimensions"))

    # -- the mlx thread's slices ------------------------------------------------------------------
    def run(self, budget: int) -> int:
        """One slice: a padded batch of at most `budget` tokens from the head of `pending` (or one chunk)."""
        if self.chunked is not None:
            return self._run_chunk(budget)
        if self.layered is not None:
            return self._run_layers(budget)
        if not self.pending:
            return 0
        first = self.pending[0]
        if len(first.tokens) > budget and self.pooling == "decoder":
            self.pending.popleft()
            self.chunked = _Chunked(first, make_prompt_cache(self.model))
            return self._run_chunk(budget)
        batch = [self.pending.popleft()]
        longest = len(first.tokens)
        while self.pending and max(longest, len(self.pending[0].tokens)) * (len(batch) + 1) <= budget:
            longest = max(longest, len(self.pending[0].tokens))
            batch.append(self.pending.popleft())
        ids, mask = _padded(batch, longest)
        if self.pooling == "encoder" and self.layer_slicing and layered_family(self.model):
            self.layered = LayerSliced(batch, longest, mx.array(ids), mx.array(mask))
            return self._run_layers(budget)
        self._deliver(batch, longest, self._forward(batch, ids, mask))
        return longest * len(batch)

    def _deliver(self, batch: list[Sequence], longest: int, vectors: np.ndarray) -> None:
        for sequence, vector in zip(batch, vectors):
            sequence.job.deliver(sequence.index, vector, len(sequence.tokens))
        self.counts["batches"] += 1
        self.counts["shared_batches"] += len({id(sequence.job) for sequence in batch}) > 1  # across requests
        self.counts["inputs"] += len(batch)
        self.counts["tokens"] += longest * len(batch)

    def _run_layers(self, budget: int) -> int:
        """One slice of the batch in flight: k encoder layers (the first slice also runs the embeddings
        layer, the last one the pooling: both cost a fraction of a layer, and a slice of their own
        would cost a whole tick of every embedding request's latency, halving the throughput).

        Returns the slice's work in tokens of a whole forward pass (k layers of an n-token batch:
        n * k / layers), the unit the queue's per-token measure prices slices in.
        """
        state = self.layered
        model = self.model
        layers = model.encoder.layer
        family = layered_family(model)
        hidden = state.hidden
        if state.layer < 0:  # as the package's Model.__call__ does before its encoder
            if family == "bert":
                hidden = model.embeddings(state.ids, None)
                state.extended = model.get_extended_attention_mask(state.attention)
            else:
                token_types = mx.zeros(state.ids.shape, dtype=mx.int64)
                hidden = model.embeddings(state.ids, token_types, None)
                state.extended = model.get_extended_attention_mask(state.attention, state.ids.shape)
            state.layer = 0
        tokens = state.longest * len(state.batch)
        count = max(1, min(len(layers) - state.layer, budget * len(layers) // max(tokens, 1)))
        for layer in layers[state.layer:state.layer + count]:
            hidden = layer(hidden, state.extended)
            if family == "xlm_roberta":  # its layers return (hidden,) + attentions
                hidden = hidden[0]
        state.layer += count
        self.counts["layer_slices"] += 1
        if state.layer < len(layers):
            mx.eval(hidden, state.extended)  # the slice's work happens now, not in a later slice
            state.hidden = hidden
        else:
            self.layered = None
            self._deliver(state.batch, state.longest, self._pooled(hidden, state.attention, None))
        return max(1, tokens * count // len(layers))

    def _pooled(self, hidden: mx.array, attention: mx.array, text_embeds: mx.array | None) -> np.ndarray:
        """The encoder's vectors from its last hidden state: the package's mean pooling, or [CLS]."""
        if self.cls_pooling:  # the model's sentence-transformers config pools the [CLS] token (BGE…)
            return _normalized(hidden[:, 0])
        if text_embeds is None:  # layer slices: the package's own pooling (its Model.__call__'s last lines)
            from mlx_embeddings.models.base import mean_pooling, normalize_embeddings

            text_embeds = normalize_embeddings(mean_pooling(hidden, attention))
        if text_embeds.ndim == 3:  # a checkpoint the package does not pool (ModernBERT's masked-LM head)
            weights = attention[..., None]
            text_embeds = (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1e-9)
        return _normalized(text_embeds)

    def _forward(self, batch: list[Sequence], ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if self.pooling == "encoder":
            attention = mx.array(mask)
            out = self.model(mx.array(ids), attention_mask=attention)
            return self._pooled(out.last_hidden_state, attention, out.text_embeds)
        hidden = self.model.model(mx.array(ids))
        last = mx.array([len(sequence.tokens) - 1 for sequence in batch])
        return _normalized(hidden[mx.arange(len(batch)), last])

    def _run_chunk(self, budget: int) -> int:
        chunked = self.chunked
        tokens = chunked.sequence.tokens
        piece = tokens[chunked.done:chunked.done + budget]
        hidden = self.model.model(mx.array([piece]), cache=chunked.cache)
        chunked.done += len(piece)
        if chunked.done < len(tokens):
            mx.eval(hidden, [c.state for c in chunked.cache])
            return len(piece)
        vector = _normalized(hidden[:, -1])[0]
        chunked.sequence.job.deliver(chunked.sequence.index, vector, len(tokens))
        self.chunked = None
        self.counts["batches"] += 1
        self.counts["inputs"] += 1
        self.counts["tokens"] += len(tokens)
        return len(piece)


def _padded(batch: list[Sequence], longest: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded token ids (0) and the 1/0 attention mask of a batch."""
    ids = np.zeros((len(batch), longest), dtype=np.int32)
    mask = np.zeros((len(batch), longest), dtype=np.float32)
    for row, sequence in enumerate(batch):
        ids[row, :len(sequence.tokens)] = sequence.tokens
        mask[row, :len(sequence.tokens)] = 1
    return ids, mask


def _normalized(pooled: mx.array) -> np.ndarray:
    """L2-normalized float32 rows (a no-op on the encoders' already normalized `text_embeds`)."""
    pooled = pooled.astype(mx.float32)
    pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return np.array(pooled, dtype=np.float32)


def _max_tokens(config: dict[str, Any], tokenizer: Any) -> int:
    """The model's input-length limit: its position table (RoBERTa's offset taken off), or the tokenizer's."""
    positions = config.get("max_position_embeddings") or 0
    if config.get("model_type") in _OFFSET_POSITIONS and positions > 2:
        positions -= 2
    tokenizer_limit = getattr(tokenizer, "model_max_length", 0) or 0
    limits = [n for n in (positions, tokenizer_limit) if isinstance(n, int) and 0 < n < 10**7]
    return min(limits) if limits else 512


def load_embedding_model(name: str, path: str) -> EmbeddingModel:
    """Loads `path` with the package its pooling needs (`pooling_of`)."""
    directory = Path(path)
    pooling = pooling_of(directory)
    if pooling is None:
        raise ValueError(f"{name} is not an embedding model")
    config = _read_json(directory / "config.json")
    if pooling == "encoder":
        from mlx_embeddings import load as load_encoder

        model, wrapper = load_encoder(path)
    else:
        from mlx_lm import load as load_decoder

        model, wrapper = load_decoder(path)
    tokenizer = getattr(wrapper, "_tokenizer", wrapper)
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    hidden = int(config.get("hidden_size") or text_config.get("hidden_size") or 0)
    # Matryoshka-trained: the config declares its sizes (jina, nomic…), or a Qwen3-Embedding-style decoder
    # (the family is trained for 32…1024-dim outputs); the operator may say otherwise (`embedding_dimensions`).
    matryoshka = bool(config.get("matryoshka_dimensions")) or pooling == "decoder"
    loaded = EmbeddingModel(
        name=name, path=path, model=model, tokenizer=tokenizer, pooling=pooling,
        max_tokens=_max_tokens(config, tokenizer), dimensions=hidden, matryoshka=matryoshka,
        cls_pooling=pooling == "encoder" and bool(_read_json(directory / "1_Pooling" / "config.json")
                                                   .get("pooling_mode_cls_token")),
        vocab_size=int(config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer.get_vocab())),
        weight_bytes=sum(p.nbytes for _, p in tree_flatten(model.parameters())))
    log.info("embedding model %s: %s pooling, %d dimensions, inputs up to %d tokens%s", name,
             "mean (mlx-embeddings)" if pooling == "encoder" else "last-token (mlx-lm)", hidden, loaded.max_tokens,
             ", Matryoshka dimensions" if matryoshka else "")
    return loaded


load_embedding_model.accepts = lambda path: pooling_of(Path(path)) is not None  # type: ignore[attr-defined]
register_loader("embedding", load_embedding_model)
