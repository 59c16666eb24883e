"""The one model in memory: load, evict, unload. Runs on the mlx thread only."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load

from engine_daemon.cpu import parallel_ops as cpu_parallel
from engine_daemon.errors import RequestError
from engine_daemon.models.digest import weights_digest
from engine_daemon.models.identity import model_identity
from engine_daemon.models.loaded import LoadedModel, kv_bytes_per_token, read_generation_defaults
from engine_daemon.models.names import ModelNames, apply_profile
from engine_daemon.models.sharded import load_shard
from engine_daemon.models.store import ModelRef, context_window_of_config, model_kind
from engine_daemon.models.vlm_loader import load_vision_model

AUXILIARY_KINDS = ("transcription", "speech")  # kinds `model_kind` names that only an auxiliary slot loads

log = logging.getLogger(__name__)


class ModelManager:
    """Keeps at most one model loaded; a different model evicts the current one."""

    def __init__(self, trust_remote_code: bool = False, names: ModelNames | None = None,
                 group: Any = None, group_mode: str | None = None) -> None:
        # Off by default: a model directory's *.py would run inside the engine (--trust-remote-code).
        self.trust_remote_code = trust_remote_code
        self.names = names or ModelNames()
        self.current: LoadedModel | None = None
        self.loads = 0
        self.last_load_seconds = 0.0
        # (model id, monotonic start) while a load runs: the io thread reports it in /health and the log.
        self.loading: tuple[str, float] | None = None
        # Engine groups: this rank loads only its shard (`load_shard`) of the group's one text model.
        self.group, self.group_mode = group, group_mode

    def ensure(self, ref: ModelRef) -> LoadedModel:
        """The loaded model for `ref` with its name's settings, loading it (and evicting another) when needed."""
        if self.current is not None and self.current.ref == ref:
            return self.current
        self.loading = (ref.id, time.monotonic())
        try:
            _fault_injected_load_delay()
            loaded = self._load(ref)
        finally:
            self.loading = None
        apply_profile(loaded, self.names.profile_for(ref))
        return loaded

    def _load(self, ref: ModelRef) -> LoadedModel:
        """Loads `ref` with mlx-lm (text) or mlx-vlm (vision/audio), evicting the current model."""
        if self.current is not None and self.current.ref == ref:
            return self.current
        kind = model_kind(ref.path)
        if kind in AUXILIARY_KINDS:  # refused before the current model is unloaded: it keeps serving
            raise RequestError(400, "invalid_model", f"'{ref.id}' is a {kind} model: it serves /v1/audio/"
                               f"{'transcriptions' if kind == 'transcription' else 'speech'}, not generation",
                               param="model")
        self.unload()
        if kind != "text":
            if self.group_mode:
                raise ValueError("engine groups serve text models only (mlx-vlm has no sharded load)")
            return self._load_vision(ref)
        log.info("loading model %s from %s", ref.id, ref.path)
        identity = model_identity(ref.path)  # before the weights are read: a file changed meanwhile never matches
        started = time.perf_counter()
        tokenizer_config = {"trust_remote_code": True} if self.trust_remote_code else None
        if self.group_mode:
            model, tokenizer, config = load_shard(ref.path, self.group_mode, self.group, self.trust_remote_code,
                                                  tokenizer_config)
        else:
            model, tokenizer, config = mlx_lm_load(str(ref.path), return_config=True,
                                                   trust_remote_code=self.trust_remote_code,
                                                   tokenizer_config=tokenizer_config)
        self.last_load_seconds = time.perf_counter() - started
        self.loads += 1
        cpu_parallel.install()  # the model's module is imported now: split its CPU element-wise work
        parameters = [p for _, p in tree_flatten(model.parameters())]
        itemsize = max((p.dtype.size for p in parameters if mx.issubdtype(p.dtype, mx.floating)), default=2)
        self.current = LoadedModel(
            ref=ref,
            model=model,
            tokenizer=tokenizer,
            context_window=context_window_of_config(config),
            vocab_size=int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0),
            weights_bytes=sum(p.nbytes for p in parameters),
            # In a group each rank holds 1/N of the KV (TP: its heads, PP: its layers): --memory-budget is per rank.
            kv_bytes_per_token=-(-kv_bytes_per_token(config, itemsize) // self._ranks()),
            generation_defaults=read_generation_defaults(ref.path),
            identity=identity,
            group_mode=self.group_mode,
            # Every rank hashes the whole checkpoint's files (a sample of each tensor): rank 0 compares them at start.
            weights_digest=weights_digest(ref.path) if self.group_mode else "",
        )
        log.info("loaded model %s in %.2f s (load #%d)", ref.id, self.last_load_seconds, self.loads)
        _freeze_heap()
        return self.current

    def _ranks(self) -> int:
        return self.group.size() if self.group_mode else 1

    def _load_vision(self, ref: ModelRef) -> LoadedModel:
        """A vision/audio model: mlx-vlm model + processor (load_vision_model imports mlx-vlm)."""
        log.info("loading %s model %s from %s with mlx-vlm", model_kind(ref.path), ref.id, ref.path)
        started = time.perf_counter()
        identity = model_identity(ref.path)
        self.current = load_vision_model(ref, trust_remote_code=self.trust_remote_code)
        self.current.identity = identity
        self.last_load_seconds = time.perf_counter() - started
        self.loads += 1
        log.info("loaded model %s in %.2f s (load #%d)", ref.id, self.last_load_seconds, self.loads)
        _freeze_heap()
        return self.current

    def unload(self) -> bool:
        """Frees the current model; False when nothing was loaded."""
        if self.current is None:
            return False
        log.info("unloading model %s", self.current.ref.id)
        self.current = None
        gc.unfreeze()  # the model's objects were frozen at load (`_freeze_heap`): let the collector see them
        gc.collect()
        mx.clear_cache()
        return True


def _freeze_heap() -> None:
    """Moves every object alive after a load out of the collector's sight (`gc.freeze`).

    A model and its tokenizer leave ~100k long-lived Python objects. Each full collection
    walks all of them: 30-70 ms with the GIL held, measured in the engine while streams
    decode, which is a gap in every stream as long as a decode step. Frozen, they are
    never walked again, and a full collection costs what the objects made since cost.
    `ModelManager.unload` unfreezes them, so a switched-out model is still collected.
    """
    gc.collect()
    gc.freeze()


def _fault_injected_load_delay() -> None:
    """Tests only (MLX_ENGINE_FAULT_INJECTION=1): a slow load, so /health can be seen reporting it."""
    seconds = os.environ.get("MLX_ENGINE_DEBUG_LOAD_SECONDS")
    if seconds and os.environ.get("MLX_ENGINE_FAULT_INJECTION") == "1":
        log.warning("fault injection: model load delayed %s s", seconds)
        time.sleep(float(seconds))
