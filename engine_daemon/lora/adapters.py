"""LoRA adapters on the loaded model: a registry of names, adapter weights in memory, switching.

Why switching and not `mlx_lm.load(..., adapter_path=)`: that loads the base model
again for every adapter. Here the base model is loaded once. The first adapter that
touches a linear layer wraps it in a `SwitchableLoRA` (the base layer stays inside,
untouched); every wrapper reads the active adapter's `lora_a`/`lora_b` from the
model's `AdapterSwitch` while the forward pass is being built. Switching adapters is
therefore a pointer change between two model calls: no base weight is copied,
reloaded or fused, and "no adapter" is the plain base layer. The arithmetic is
mlx-lm's `LoRALinear` exactly (`y + (scale * ((x @ a) @ b)).astype(x.dtype)`), so a
request gets the tokens `mlx_lm.load(model, adapter_path=...)` would give.

Adapters come in mlx-lm's format (`adapter_config.json` + `adapters.safetensors`,
as `mlx_lm.lora` writes them; `fine_tune_type` "lora" on linear layers). Requests
name one by a registered name or by a directory inside the `--model-dir` roots:
like model names, paths from clients are confined to those roots, never any path
(`resolve_adapter_dir`). Loaded adapter weights are kept in a small LRU
(`--adapter-cache-size`), keyed by path and file version, so an adapter rewritten
on disk is loaded afresh.

Everything here runs on the mlx thread, except `AdapterRegistry.snapshot`, which
the io thread reads for `adapters.list` (it is replaced, never mutated).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_daemon.errors import RequestError, describe
from engine_daemon.lora.layers import AdapterSwitch, AdapterWeights, BoundModel, load_adapter_weights
from engine_daemon.lora.registry import (
    NAME_PATTERN,
    AdapterRegistry,
    file_version,
)

log = logging.getLogger(__name__)


def refuse_in_group(loaded: Any, param: str = "adapter_path") -> None:
    """An engine group serves no adapter (a TP shard's layers are not the adapter's shapes, and followers could
    not replay one): the documented 400 unsupported_in_group, before the adapter is looked up or checked."""
    if loaded is not None and getattr(loaded, "group_mode", None):
        raise RequestError(400, "unsupported_in_group", "LoRA adapters are not served by an engine group",
                           param=param)


class AdapterManager:
    """Registry + loaded weights + the switch of the loaded model, and the counters /stats shows."""

    def __init__(self, roots: Sequence[Path] = (), cache_size: int = 8, default_path: str | Path | None = None,
                 default_model: str | None = None):
        self.registry = AdapterRegistry(roots)
        self.cache_size = max(1, cache_size)
        self.default_model = default_model
        self._default_model_path: Path | None = None  # --model's directory, known once it has loaded
        self._cache: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._switch: AdapterSwitch | None = None
        self.loads = 0
        if default_path is not None:
            name = Path(default_path).expanduser().resolve().name or "default"
            if not NAME_PATTERN.match(name):
                name = "default"
            self.registry.add(name, str(default_path), trusted=True)
            self.registry.default = name
            self.registry._publish()

    # -- per model ------------------------------------------------------------------------
    def switch_for(self, loaded: Any) -> AdapterSwitch:
        """The loaded model's switch; a new model starts with no wrappers and an empty weight cache."""
        if self._switch is None or self._switch.model() is not loaded.model:
            self._switch = AdapterSwitch(loaded.model)
            self._cache.clear()
        return self._switch

    def bind(self, loaded: Any, key: str | None) -> BoundModel:
        """The model to generate with for requests of adapter `key` (None: the base model)."""
        return BoundModel(loaded.model, self.switch_for(loaded), self.weights(loaded, key) if key else None)

    def weights(self, loaded: Any, key: str) -> AdapterWeights:
        """Cached weights of an admitted adapter (reloaded if the LRU dropped them meanwhile)."""
        self.switch_for(loaded)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        path = Path(key.rsplit("@", 1)[0])
        return self._load(loaded, path.name, path)

    def _load(self, loaded: Any, name: str, path: Path) -> AdapterWeights:
        switch = self.switch_for(loaded)
        key = f"{path}@{file_version(path)}"
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        weights = load_adapter_weights(name, path)
        switch.check(weights)
        self.loads += 1
        log.info("loaded adapter %s from %s (rank %d, %d layers, %.1f KiB; adapter load #%d)", name, path,
                 weights.rank, len(weights.layers), weights.nbytes / 1024, self.loads)
        self._cache[weights.key] = weights
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return weights

    # -- requests and CALLs ---------------------------------------------------------------
    def admit(self, spec: str | None, loaded: Any) -> str | None:
        """The adapter key a request runs with (None: the base model); RequestError to refuse it."""
        if spec is None and self.registry.default is not None and self._is_default_model(loaded):
            spec = self.registry.default
        if spec is None:
            return None
        refuse_in_group(loaded)
        if not isinstance(spec, str):
            raise RequestError(400, "invalid_type", "'adapter' must be a string", param="adapter_path")
        if loaded.kind != "text":
            raise RequestError(400, "unsupported_adapter", f"Adapters are served for text models; '{loaded.ref.id}' "
                               f"is a {loaded.kind} model", param="adapter_path")
        name, path = self.registry.lookup(spec)
        try:
            return self._load(loaded, name, path).key
        except OSError as exc:
            raise RequestError(404, "adapter_not_found", f"Adapter '{spec}' could not be read: {describe(exc)}",
                               param="adapter_path") from None

    def _is_default_model(self, loaded: Any) -> bool:
        """`loaded` is --model (by directory: it may be served under --served-model-name or an alias)."""
        return loaded.ref.id == self.default_model or loaded.ref.path == self._default_model_path

    def add(self, args: dict[str, Any], loaded: Any) -> dict[str, Any]:
        """adapters.add {name, path}: registered, and checked against the loaded text model if any."""
        name, path = args.get("name"), args.get("path")
        if not isinstance(path, str):
            raise RequestError(400, "invalid_value", "'path' must be a string", param="path")
        refuse_in_group(loaded, param="path")
        described = self.registry.add(name, path)
        if loaded is not None and loaded.kind == "text":
            try:
                self._load(loaded, name, self.registry.lookup(name)[1])
            except RequestError as exc:
                self.registry.remove(name)  # an adapter that cannot run on this model is not registered
                exc.param = "path"
                raise
        return described

    def remove(self, args: dict[str, Any]) -> dict[str, Any]:
        name = args.get("name")
        if not isinstance(name, str):
            raise RequestError(400, "invalid_value", "'name' must be a string", param="name")
        path = self.registry.path_of(name)
        self.registry.remove(name)
        for key in [k for k, w in self._cache.items() if w.path == path]:
            del self._cache[key]  # running requests keep their own reference
        return {"id": name, "object": "adapter", "deleted": True}

    def warm(self, loaded: Any) -> None:
        """Loads and checks the --adapter-path adapter with the model at start, so a mismatch is logged early."""
        if self.registry.default is not None and loaded is not None:
            self._default_model_path = loaded.ref.path  # called once, with the model loaded at start
            try:
                self.admit(None, loaded)
            except RequestError as exc:
                log.error("--adapter-path %s does not fit model %s: %s", self.registry.default, loaded.ref.id, exc)

    def stats(self) -> dict[str, Any]:
        switch = self._switch
        return {"adapter": self.registry.default, "adapter_loads": self.loads,
                "adapter_switches": switch.switches if switch else 0,
                "adapters": {"registered": len(self.registry.snapshot), "loaded": len(self._cache),
                             "cache_size": self.cache_size,
                             "loaded_bytes": sum(w.nbytes for w in self._cache.values()),
                             "wrapped_layers": len(switch.wrapped) if switch else 0,
                             "active": switch.active.name if switch and switch.active else None}}
