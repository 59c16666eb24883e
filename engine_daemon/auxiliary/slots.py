"""One slot per auxiliary kind beside the generation model; used on the mlx thread only.

A RAG app needs an embedding model and a chat model at once, so an auxiliary model never
evicts the generation model (`ModelManager.loads` does not move): it takes its kind's slot,
replacing only a model of the same kind. Each load is checked against `--memory-budget`
first, counting the generation model and the other slots, and refused with the engine's
usual 400 `memory_budget_exceeded` when it would not fit.

Names resolve as the generation model's do (`ModelNames.resolve`: the operator's names,
`--model-dir`, the HF cache; the operator's `--<kind>-model` is trusted as typed). A name
that is not a model of the kind asked for reaches the kind's configured model when there is
one (clients send hard-coded names such as `text-embedding-3-small`), else it is a 404.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine_daemon.auxiliary.model import KINDS, AuxiliaryModel, loader_for, weights_on_disk
from engine_daemon.errors import RequestError
from engine_daemon.models.names import ModelNames
from engine_daemon.models.store import InvalidModelName, ModelNotFound, ModelRef

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    model: AuxiliaryModel
    loaded_at: float  # wall clock, as /v1/models' `created`
    last_used: float  # monotonic


class AuxiliarySlots:
    """The auxiliary models: loaded on first use (or preloaded), unloaded by /unload and --idle-unload."""

    def __init__(self, names: ModelNames | None = None, *, roots: Sequence[Path] = (), allow_download: bool = False,
                 memory_budget_bytes: int | None = None, main_weight_bytes: Callable[[], int] = lambda: 0,
                 preload: dict[str, str] | None = None,
                 accepts: Callable[[str, Path], bool] | None = None):
        self.names = names or ModelNames()
        self.roots = tuple(roots)
        self.allow_download = allow_download
        self.memory_budget_bytes = memory_budget_bytes
        self.main_weight_bytes = main_weight_bytes
        self.preload = {kind: name for kind, name in (preload or {}).items() if name}
        # (kind, directory) -> whether it holds a model of that kind; default: the kind's module decides
        self.accepts = accepts or _kind_accepts
        self.slots: dict[str, _Slot] = {}
        self.loads = 0
        # (name, monotonic start) while a load runs: a long load is not a stalled engine (`EngineServer.state`)
        self.loading: tuple[str, float] | None = None
        # What /health, /stats and /v1/models show: replaced (never mutated) on every change, so the
        # io thread reads it without a lock.
        self.snapshot: list[dict[str, Any]] = []
        self.dirs: list[str] = []  # the loaded models' directories, published with `snapshot`
        self._fallback_logged: set[tuple[str, str]] = set()

    # -- serving ---------------------------------------------------------------------------------
    def get(self, kind: str, name: str | None) -> AuxiliaryModel:
        """The model of `kind` that `name` asks for, loading it (and replacing that kind's model) when needed."""
        if kind not in KINDS:
            raise RequestError(400, "invalid_value", f"Unknown model kind {kind!r}")
        slot = self.slots.get(kind)
        if slot is not None and (not name or name == "default" or name in (slot.model.name, slot.model.path)):
            return self._use(slot)
        served_as, path = self.resolve(kind, name)
        slot = self.slots.get(kind)
        if slot is not None and Path(slot.model.path) == path:
            return self._use(slot)
        return self._use(self._load(kind, served_as, path))

    def resolve(self, kind: str, name: str | None) -> tuple[str, Path]:
        """(name to serve under, directory) for a request's `model`; RequestError when there is none."""
        configured = self.preload.get(kind)
        if not name or name == "default":
            if not configured:
                raise RequestError(400, "model_required", f"No {kind} model is configured; name one in 'model'",
                                   param="model")
            name = configured
        try:
            ref = self.names.resolve(name, default_model=configured, roots=self.roots,
                                     allow_download=self.allow_download)
            if self.accepts(kind, ref.path):
                return ref.id, ref.path
            problem: RequestError = RequestError(400, "invalid_model",
                                                 f"The model '{name}' is not a model of kind '{kind}'", param="model")
        except InvalidModelName as exc:
            raise RequestError(400, "invalid_model_name", str(exc), param="model") from None
        except ModelNotFound as exc:
            problem = RequestError(404, "model_not_found", str(exc), param="model")
        if not configured or name == configured:
            raise problem
        if (kind, name) not in self._fallback_logged and len(self._fallback_logged) < 1024:
            self._fallback_logged.add((kind, name))
            log.info("%s model %r: served by the configured %s model %s", kind, name[:255], kind, configured)
        return self.resolve(kind, configured)

    def _load(self, kind: str, name: str, path: Path) -> _Slot:
        self._check_budget(kind, name, path)
        loader = loader_for(kind)
        self.unload(kind)
        log.info("loading %s model %s from %s", kind, name, path)
        started = time.perf_counter()
        self.loading = (name, time.monotonic())
        try:
            model = loader(name, str(path))
        finally:
            self.loading = None
        if hasattr(model, "profile"):  # its name's --models-config settings (e.g. `embedding_dimensions`)
            model.profile = self.names.profile_for(ModelRef(name, path))
        self.loads += 1
        slot = self.slots[kind] = _Slot(model, time.time(), time.monotonic())
        log.info("loaded %s model %s in %.2f s (%.0f MiB)", kind, name, time.perf_counter() - started,
                 model.weight_bytes / 2**20)
        self._publish()
        return slot

    def _check_budget(self, kind: str, name: str, path: Path) -> None:
        budget = self.memory_budget_bytes
        if budget is None:
            return
        needed = weights_on_disk(path)
        main = self.main_weight_bytes()
        others = sum(slot.model.weight_bytes for other, slot in self.slots.items() if other != kind)
        if main + others + needed > budget:
            raise RequestError(400, "memory_budget_exceeded",
                               f"Loading the {kind} model '{name}' ({needed / 2**20:.0f} MiB) beside the generation "
                               f"model ({main / 2**20:.0f} MiB) and the other auxiliary models "
                               f"({others / 2**20:.0f} MiB) exceeds the engine's memory budget of "
                               f"{budget / 2**20:.0f} MiB", param="model")

    def _use(self, slot: _Slot) -> AuxiliaryModel:
        slot.last_used = time.monotonic()
        self._publish()
        return slot.model

    # -- freeing ---------------------------------------------------------------------------------
    def unload(self, kind: str | None = None) -> list[str]:
        """Frees the model of `kind` (None: every kind); the names unloaded."""
        kinds = [kind] if kind is not None else list(self.slots)
        gone = []
        for each in kinds:
            slot = self.slots.pop(each, None)
            if slot is None:
                continue
            log.info("unloading %s model %s", each, slot.model.name)
            slot.model.close()
            gone.append(slot.model.name)
        if gone:
            gc.collect()
            mx.clear_cache()
            self._publish()
        return gone

    def unload_idle(self, now: float, idle_seconds: float | None) -> list[str]:
        """--idle-unload: frees each model unused for `idle_seconds` (monotonic `now`)."""
        if not idle_seconds:
            return []
        gone = []
        for kind, slot in list(self.slots.items()):
            if now - slot.last_used >= idle_seconds:
                log.info("%s model %s unused for %.0f s (--idle-unload %g)", kind, slot.model.name,
                         now - slot.last_used, idle_seconds)
                gone += self.unload(kind)
        return gone

    def counters(self) -> dict[str, dict[str, int]]:
        """For /stats: each loaded model's own work counters (embedding batches, inputs, tokens), by kind."""
        return {kind: dict(getattr(slot.model, "counts", {})) for kind, slot in list(self.slots.items())}

    def weight_bytes(self) -> int:
        return sum(slot.model.weight_bytes for slot in self.slots.values())

    # -- reporting -------------------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """[{kind, name, weight_bytes, loaded_at, last_used}] of the loaded models (a published snapshot)."""
        return self.snapshot

    def _publish(self) -> None:
        now_wall, now = time.time(), time.monotonic()
        self.dirs = [str(slot.model.path) for slot in self.slots.values()]
        self.snapshot = [{"kind": kind, "name": slot.model.name, "weight_bytes": slot.model.weight_bytes,
                          "loaded_at": slot.loaded_at, "last_used": now_wall - (now - slot.last_used)}
                         for kind, slot in self.slots.items()]

    def loaded_dirs(self) -> list[str]:
        """The loaded models' directories: another name of one is served without a load (/v1/models `loaded`)."""
        return self.dirs

    def catalogue(self) -> list[dict[str, Any]]:
        """/v1/models entries: the loaded auxiliary models and the configured ones not loaded yet."""
        entries = [{"id": slot["name"], "created": int(slot["loaded_at"]), "kind": slot["kind"], "loaded": True}
                   for slot in self.snapshot]
        loaded_kinds = {slot["kind"]: slot["name"] for slot in self.snapshot}
        for kind, name in self.preload.items():
            if loaded_kinds.get(kind) != name:
                entries.append({"id": name, "created": 0, "kind": kind, "loaded": False})
        return entries


def _kind_accepts(kind: str, path: Path) -> bool:
    """Whether `path` holds a model of `kind`, as that kind's module judges (its `accepts`)."""
    loader = loader_for(kind)
    accepts = getattr(loader, "accepts", None)
    return bool(accepts(path)) if accepts is not None else True
