"""Continuous batching for vision models: mlx-vlm's BatchGenerator behind the engine's scheduler.

`BatchScheduler` drives mlx-lm's BatchGenerator for text models. For a vision model it
drives `VisionBatchGenerator` instead, which speaks the same small interface
(`insert_request` / `next` / `remove` / `close` / `prefill_step_size`) on top of
mlx-vlm's own BatchGenerator. So image requests and text requests to a vision model share
one batch: they decode together, prompts are prefilled in paced chunks between decode
steps (a long image prompt never stalls running streams for its whole prefill), and
admission, stop strings, output parsing and aborts stay the scheduler's, as for text.

mlx-vlm batches prompts as input embeddings: each request's embeddings are computed when
it joins (vision tower + projector, through the per-image feature cache of
`engine_daemon.multimodal.inputs.prepare`), then mlx-vlm prefills them in chunks.

Prompt KV is reused across requests by mlx-vlm's own automatic prefix cache (`mlx_vlm.apc`:
hash-chained 16-token KV blocks, LRU under a byte cap), the vision counterpart of the text
models' `PrefixCache`: a text conversation with a vision model prefills only what is new.
In memory, mlx-vlm reuses a block prefix only while the prompt holds no image token, so an
image prompt is prefilled again (its features come from the feature cache). With
`--prompt-cache-dir` the manager is `prefix_cache.vision_apc.TieredAPCManager`: prompts leave
memory for the text models' disk tier (evicted, or all of them on a model switch or a clean
shutdown) and come back after a switch back or a restart, image prompts included when the
stored prefix covers every image (see that module for why that is sound with M-RoPE). The
hash chain is salted with the content hashes of the request's images and audio in prompt
order (`VisionInputs.media_keys`), as mlx-vlm salts with the pixels: image placeholders are
the same tokens for every image, so token ids alone could let one image's KV answer for
another; the salt is part of every disk entry's key too.

Two things mlx-vlm's generator does generator-wide, the engine does per request:
* sampling: the generator samples greedily; a request with its own sampling settings
  carries a last logits processor (`RequestHead`) that draws its token with the request's
  sampler (seed included) and leaves only that token possible;
* stopping: the generator never stops on EOS itself (`_NEVER_STOP`); the scheduler ends a
  request on EOS, a stop string or `max_tokens`, as for text models (so `ignore_eos` works).
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from engine_daemon.models.loaded import LoadedModel
from engine_daemon.models.vision_support import VisionSupport
from engine_daemon.multimodal import inputs as vision
from engine_daemon.multimodal.features import image_features
from engine_daemon.prefix_cache.disk import DiskTier
from engine_daemon.prefix_cache.vision_apc import TieredAPCManager, shared_disk_tier
from engine_daemon.request.state import EngineRequest
from engine_daemon.sampling.samplers import make_request_processors, make_request_sampler

log = logging.getLogger(__name__)


class _NeverStop:
    """mlx-vlm's stopping-criteria interface, answering "go on" for every token."""

    def __call__(self, token: int) -> bool:
        return False

    def add_eos_token_ids(self, token_ids: Any = None) -> None:
        pass


# What mlx-vlm's BatchGenerator reads from its `processor` argument: the tokenizer's stopping criteria.
_NEVER_STOP = SimpleNamespace(tokenizer=SimpleNamespace(stopping_criteria=_NeverStop()))


class RequestHead:
    """Last logits processor of a request: its own sampling and logprobs inside a shared batch.

    mlx-vlm applies per-request processors row by row, so this sees exactly the request's
    logits (after logit_bias, penalties and grammar) and nothing else. The i-th call
    belongs to the i-th token the request emits: the log-probabilities wait in `pending`
    until that token comes out.
    """

    def __init__(self, sampler: Any | None, keep_logprobs: bool):
        self.sampler = sampler
        self.keep_logprobs = keep_logprobs
        self.pending: deque[mx.array] = deque()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.keep_logprobs:
            self.pending.append(logprobs)
        if self.sampler is None:
            return logits
        token = self.sampler(logprobs)
        chosen = mx.arange(logits.shape[-1]) == token.reshape(-1, 1)
        return mx.where(chosen, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, dtype=logits.dtype))

    def pop(self) -> mx.array | None:
        return self.pending.popleft() if self.pending else None


@dataclass
class VisionResponse:
    """One generated token, in the shape BatchScheduler.step reads from mlx-lm's responses."""

    uid: int
    token: int
    logprobs: mx.array | None
    finish_reason: str | None
    all_tokens: list[int] | None = None  # no text prompt cache for vision models
    prompt_cache: Any = None


@dataclass
class PromptProgress:
    """Prompt tokens a prefill batch has processed so far, for BatchScheduler's prefill pacer."""

    uid: int
    progress: tuple[int, int]
    end_of_prompt: bool


def _prefix_cache(loaded: LoadedModel, memory_bytes: int, disk: DiskTier | None) -> Any:
    """mlx-vlm's prefix cache with our disk tier behind it (`TieredAPCManager`), or None when off."""
    if memory_bytes <= 0:
        return None
    from mlx_vlm.apc import multimodal_token_ids_from_config

    return TieredAPCManager(memory_bytes, disk, loaded.identity,
                            multimodal_token_ids_from_config(loaded.model.config))


def _media_salt(media_keys: list[str]) -> int:
    """A stable 63-bit salt for the KV hash chain from the prompt's media, 0 for text-only prompts."""
    if not media_keys:
        return 0
    digest = hashlib.sha256("\n".join(media_keys).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _counting_generator_class() -> type:
    """mlx-vlm's BatchGenerator, telling which prompt tokens each request took from the prefix cache."""
    from mlx_vlm.generate import BatchGenerator

    class CountingBatchGenerator(BatchGenerator):
        on_prefix: Any = None

        def _apc_pick_for(self, sequence: Any) -> dict | None:
            pick = super()._apc_pick_for(sequence)
            if self.on_prefix is not None:
                self.on_prefix(sequence[0], int(pick["prefix_len"]) if pick else 0)
            return pick

    return CountingBatchGenerator


class VisionBatchGenerator:
    """mlx-vlm's BatchGenerator for one loaded vision model, with the engine's per-request semantics."""

    def __init__(self, loaded: LoadedModel, *, max_tokens: int, completion_batch_size: int,
                 prefill_batch_size: int, prefill_step_size: int, stream: Any = None,
                 prefix_cache_bytes: int = 0, disk: DiskTier | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.support: VisionSupport = loaded.vision
        self.completion_batch_size = completion_batch_size
        self.prompt_concurrency = max(1, prefill_batch_size)
        self.prefix_cache = _prefix_cache(loaded, prefix_cache_bytes, disk)
        self._gen = _counting_generator_class()(
            self.model.language_model, _NEVER_STOP, max_tokens=max_tokens,
            completion_batch_size=completion_batch_size, prefill_batch_size=self.prompt_concurrency,
            prefill_step_size=prefill_step_size, compute_logprobs=False, stream=stream, greedy_sampling=True,
            apc_manager=self.prefix_cache)
        self._gen.on_prefix = self._took_prefix
        self._requests: dict[int, EngineRequest] = {}
        self._heads: dict[int, RequestHead] = {}
        self._decoding: set[int] = set()
        self._prompt_batch: Any = None
        self._prompt_batch_seq = 0
        self._prompt_batch_tokens = 0

    # -- the interface BatchScheduler uses ---------------------------------------------------
    @property
    def prefill_step_size(self) -> int | None:
        return self._gen.prefill_step_size

    @prefill_step_size.setter
    def prefill_step_size(self, value: int) -> None:
        """The pacer's chunk size, for prompt batches to come and for the one being prefilled."""
        self._gen.prefill_step_size = value
        batch = self._current_prompt_batch()
        if batch is not None and getattr(batch, "prefill_step_size", None) is not None:
            batch.prefill_step_size = value  # None means the model asked for unchunked prefill: keep it

    def insert_request(self, request: EngineRequest) -> int:
        """Embeds the request's prompt (images through the feature cache) and queues it for prefill."""
        inputs = vision.take_inputs(request)
        kwargs = dict(inputs.extra)
        features = image_features(self.model, self.support, inputs)
        if features is not None:
            kwargs["cached_image_features"] = features
        elif inputs.image_keys:
            self.support.features.encoded += len(inputs.image_keys)  # encoded inside get_input_embeddings
        with mx.stream(self._gen.stream):
            embedded = self.model.get_input_embeddings(inputs.input_ids, inputs.pixel_values, mask=inputs.mask,
                                                       **kwargs)
        kwargs.pop("cached_image_features", None)
        prompt_kwargs = {**kwargs, **{k: v for k, v in embedded.to_dict().items() if v is not None}}
        if self.prefix_cache is not None:
            # Without it mlx-vlm would salt with a hash of the whole prompt's embeddings: no prefix could match.
            prompt_kwargs["_apc_semantic_hash"] = _media_salt(inputs.media_keys)
        sampling = request.sampling
        greedy = float(sampling.get("temperature", 0.0)) == 0.0
        head = RequestHead(None if greedy else make_request_sampler(sampling),
                           keep_logprobs=bool(request.params.get("logprobs")))
        processors = make_request_processors(sampling) + list(request.processors)
        if head.sampler is not None or head.keep_logprobs:
            processors.append(head)
        (uid,) = self._gen.insert([request.prompt_tokens], max_tokens=[request.max_tokens],
                                  prompt_kwargs=[prompt_kwargs], logits_processors=[processors or None])
        self._heads[uid] = head
        self._requests[uid] = request
        return uid

    def next(self) -> tuple[list[PromptProgress], list[VisionResponse]]:
        """One step: a decode step for the running batch, plus at most one prefill chunk."""
        # mlx-vlm admits a prompt batch only when prefill_batch_size slots are free: size it to what is free.
        free = self.completion_batch_size - len(self._decoding)
        self._gen.prefill_batch_size = max(1, min(self.prompt_concurrency, free))
        finished_prompts, generated = self._gen.next()
        responses = []
        for response in generated:
            if response.token is None:
                continue
            self._decoding.add(response.uid)
            head = self._heads.get(response.uid)
            logprobs = head.pop() if head is not None else None
            responses.append(VisionResponse(uid=response.uid, token=int(response.token), logprobs=logprobs,
                                            finish_reason=response.finish_reason))
            if response.finish_reason is not None:
                self._forget(response.uid)
        return self._progress(bool(finished_prompts)), responses

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        """Drops requests wherever they are (queued, prefilling, decoding); no caches to hand back."""
        for uid in uids:
            self._gen.remove(uid)
            self._forget(uid)
        return {}

    def close(self) -> None:
        """A model switch or a shutdown: the hot prefixes go to the disk tier first (--prompt-cache-dir)."""
        if self.prefix_cache is not None:
            try:
                self.prefix_cache.spill_all()
            except Exception:  # the cache is an optimisation: a failed write must never block a switch
                log.exception("vision prompt cache: writing the prefixes to disk failed")
        self._gen.close()
        self._requests.clear()
        self._heads.clear()
        self._decoding.clear()

    # -- helpers -------------------------------------------------------------------------------
    def _took_prefix(self, uid: int, tokens: int) -> None:
        """Counts a prefix-cache hit on the request (its usage reports it as cached_tokens)."""
        request = self._requests.get(uid)
        if request is not None:
            request.cached_tokens = tokens

    def prefix_cache_stats(self) -> dict[str, int]:
        """Hits, misses and reused tokens of the vision prefix cache, for /stats and /metrics."""
        if self.prefix_cache is None:
            return {}
        stats = self.prefix_cache.stats
        return {"vision_kv_hits": stats.hits, "vision_kv_misses": stats.misses,
                "vision_kv_cached_tokens": stats.matched_tokens, "vision_kv_stored_tokens": stats.stored_tokens,
                "vision_kv_evictions": stats.evictions, **self.prefix_cache.tier_stats()}

    def _forget(self, uid: int) -> None:
        self._requests.pop(uid, None)
        self._heads.pop(uid, None)
        self._decoding.discard(uid)

    def _current_prompt_batch(self) -> Any:
        # mlx-vlm keeps the batch being prefilled private; without it only pacing is lost, never output.
        return getattr(self._gen, "_prompt_batch", None)

    def _progress(self, prompt_batch_finished: bool) -> list[PromptProgress]:
        """Cumulative prompt tokens of the prefill batch in flight (one pseudo-uid per batch)."""
        items = []
        batch = self._current_prompt_batch()
        if self._prompt_batch is not None and (batch is not self._prompt_batch or prompt_batch_finished):
            total = int(getattr(self._prompt_batch, "total_prompt_tokens", self._prompt_batch_tokens))
            items.append(PromptProgress(-self._prompt_batch_seq, (total, total), True))
            self._prompt_batch = None
        if batch is not None:
            if batch is not self._prompt_batch:
                self._prompt_batch, self._prompt_batch_seq = batch, self._prompt_batch_seq + 1
            columns = int(getattr(batch, "_processed_prompt_columns", 0))
            rows = max(1, len(getattr(batch, "uids", ()) or ()))
            total = int(getattr(batch, "total_prompt_tokens", columns * rows))
            self._prompt_batch_tokens = min(columns * rows, total)
            items.append(PromptProgress(-self._prompt_batch_seq, (self._prompt_batch_tokens, 0), False))
        return items


def make_generator(loaded: LoadedModel, config: Any, stream: Any) -> VisionBatchGenerator:
    """The generator BatchScheduler uses while `loaded` (a vision/audio model) is loaded."""
    return VisionBatchGenerator(loaded, max_tokens=config.default_max_tokens,
                                completion_batch_size=config.decode_concurrency,
                                prefill_batch_size=config.prompt_concurrency,
                                prefill_step_size=config.prefill_step_size, stream=stream,
                                prefix_cache_bytes=_prefix_cache_bytes(config),
                                disk=shared_disk_tier(config.prompt_cache_dir, config.prompt_cache_disk_bytes))


def _prefix_cache_bytes(config: Any) -> int:
    """The text prefix cache's byte cap for the vision one (one model is loaded at a time), 0 when off."""
    if config.prompt_cache_size <= 0:
        return 0
    return int(config.prompt_cache_bytes or 1 << 30)


__all__ = ["VisionBatchGenerator", "RequestHead", "make_generator"]
