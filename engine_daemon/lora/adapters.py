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

import json
import logging
import os
import re
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine_daemon.errors import RequestError

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


# -- where adapters come from ---------------------------------------------------------------
def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def resolve_adapter_dir(spec: str, roots: Sequence[Path], param: str = "adapter_path") -> Path:
    """An adapter directory a client named, confined to the model roots (as `engine_daemon.models.store.resolve` confines models).

    Refused before the filesystem is touched: `..` components and absolute paths not
    lexically under a root. A path under a root must still resolve (links followed) inside one.
    """
    if not spec.strip() or "\0" in spec:
        raise RequestError(400, "invalid_adapter", f"'{spec}' is not a valid adapter name or path", param=param)
    if ".." in spec.replace("\\", "/").split("/"):
        raise RequestError(400, "invalid_adapter", f"The adapter path '{spec}' may not contain '..'", param=param)
    if not roots:
        raise RequestError(404, "adapter_not_found",
                           f"No adapter is registered as '{spec}', and adapter paths need the engine's "
                           "--model-dir (register adapters with POST /v1/adapters)", param=param)
    expanded = os.path.expanduser(spec) if spec.startswith("~") else spec
    if os.path.isabs(expanded):
        lexical = Path(os.path.normpath(expanded))
        if not _inside(lexical, roots):
            raise RequestError(400, "invalid_adapter", f"The adapter path '{spec}' is outside the engine's model "
                               "directories (--model-dir)", param=param)
        candidates = [lexical]
    else:
        candidates = [root / spec for root in roots]
    for candidate in candidates:
        real = candidate.resolve()
        if not _inside(real, roots):
            raise RequestError(400, "invalid_adapter", f"The adapter '{spec}' leads outside the engine's model "
                               "directories", param=param)
        if real.is_dir() and is_adapter_dir(real):
            return real
    raise RequestError(404, "adapter_not_found", f"No adapter is registered as '{spec}' and no adapter directory "
                       f"(with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}) is at that path", param=param)


def file_version(path: Path) -> str:
    """Changes when the adapter's weights file is rewritten (part of the cache key)."""
    stat = (path / ADAPTER_WEIGHTS).stat()
    return f"{stat.st_mtime_ns}-{stat.st_size}"


class AdapterRegistry:
    """Names clients may use for adapters: `--adapter-path` at start, then POST /v1/adapters."""

    def __init__(self, roots: Sequence[Path]):
        self.roots = tuple(roots)
        self._paths: dict[str, Path] = {}
        self.default: str | None = None
        # What adapters.list answers (read by the io thread): replaced on every change.
        self.snapshot: list[dict[str, Any]] = []

    def add(self, name: str, path: str, trusted: bool = False) -> dict[str, Any]:
        """Registers `name` for an adapter directory; `trusted` paths (the operator's flags) skip the roots."""
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise RequestError(400, "invalid_value", "An adapter 'name' is 1-64 letters, digits, '.', '_' or '-' "
                               "and starts with a letter or digit", param="name")
        if name in self._paths:
            raise RequestError(409, "adapter_exists", f"An adapter named '{name}' is already registered; "
                               "DELETE it first", param="name")
        if trusted:
            real = Path(path).expanduser().resolve()
            if not is_adapter_dir(real):
                raise RequestError(400, "invalid_adapter", f"{path} has no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}",
                                   param="path")
        else:
            real = resolve_adapter_dir(path, self.roots, param="path")
        read_adapter_config(real, param="path")
        self._paths[name] = real
        self._publish()
        return self.describe(name)

    def remove(self, name: str) -> None:
        if name not in self._paths:
            raise RequestError(404, "adapter_not_found", f"No adapter is registered as '{name}'", param="name")
        if name == self.default:
            raise RequestError(400, "adapter_in_use", f"'{name}' is the engine's --adapter-path adapter and "
                               "cannot be removed", param="name")
        del self._paths[name]
        self._publish()

    def lookup(self, spec: str) -> tuple[str, Path]:
        """(display name, directory) for a request's `adapter`: a registered name, else a confined path."""
        if spec in self._paths:
            return spec, self._paths[spec]
        return spec, resolve_adapter_dir(spec, self.roots)

    def path_of(self, name: str) -> Path | None:
        return self._paths.get(name)

    def describe(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "adapter", "path": str(self._paths[name]), "default": name == self.default}

    def _publish(self) -> None:
        self.snapshot = [self.describe(name) for name in sorted(self._paths)]


# -- adapter weights ------------------------------------------------------------------------
@dataclass
class AdapterWeights:
    """One adapter in memory: lora_a/lora_b per target module path, and its scale."""

    key: str  # "<dir>@<file version>": the prompt-cache and batch-group key
    name: str
    path: Path
    scale: float
    layers: dict[str, tuple[mx.array, mx.array]]
    nbytes: int
    rank: int


def read_adapter_config(path: Path, param: str = "adapter_path") -> dict[str, Any]:
    """adapter_config.json, checked for what this engine can switch (LoRA on linear layers)."""
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise RequestError(400, "invalid_adapter", f"Unreadable {ADAPTER_CONFIG}: {exc}", param=param) from None
    if not isinstance(config, dict):
        raise RequestError(400, "invalid_adapter", f"{ADAPTER_CONFIG} is not a JSON object", param=param)
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise RequestError(400, "unsupported_adapter", f"Adapters of fine_tune_type '{kind}' are not supported; "
                           "only 'lora' adapters can be switched per request (fuse others into a model)", param=param)
    scale = (config.get("lora_parameters") or {}).get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise RequestError(400, "invalid_adapter", f"{ADAPTER_CONFIG} needs a numeric lora_parameters.scale "
                           "(mlx-lm's format)", param=param)
    return config


def load_adapter_weights(name: str, path: Path) -> AdapterWeights:
    """Reads an adapter from disk into lora_a/lora_b pairs per module path."""
    config = read_adapter_config(path)
    try:
        tensors = mx.load(str(path / ADAPTER_WEIGHTS))
    except Exception as exc:  # a corrupt file is the client's/operator's problem, not an engine failure
        raise RequestError(400, "invalid_adapter", f"Unreadable {ADAPTER_WEIGHTS}: {exc}") from None
    pairs: dict[str, dict[str, mx.array]] = {}
    for tensor_name, value in tensors.items():
        module, _, leaf = tensor_name.rpartition(".")
        if leaf not in ("lora_a", "lora_b") or not module:
            raise RequestError(400, "unsupported_adapter", f"Adapter tensor '{tensor_name}' is not a LoRA "
                               "lora_a/lora_b (DoRA and full fine-tunes are not switchable)", param="adapter_path")
        pairs.setdefault(module, {})[leaf] = value
    layers = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_a", "lora_b"}:
            continue  # mlx-lm leaves such a layer with lora_b = 0: no change either way
        a, b = pair["lora_a"], pair["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise RequestError(400, "invalid_adapter", f"Adapter tensors of '{module}' have shapes {a.shape} and "
                               f"{b.shape}, not (in, r) and (r, out)", param="adapter_path")
        layers[module] = (a, b)
    if not layers:
        raise RequestError(400, "invalid_adapter", f"{ADAPTER_WEIGHTS} holds no lora_a/lora_b pairs",
                           param="adapter_path")
    mx.eval([t for pair in layers.values() for t in pair])
    return AdapterWeights(key=f"{path}@{file_version(path)}", name=name, path=path,
                          scale=float(config["lora_parameters"]["scale"]), layers=layers,
                          nbytes=sum(t.nbytes for pair in layers.values() for t in pair),
                          rank=max(a.shape[1] for a, _ in layers.values()))


# -- switching on the model -----------------------------------------------------------------
class SwitchableLoRA(nn.Module):
    """A base linear layer plus whatever LoRA pair the active adapter has for it (maybe none)."""

    def __init__(self, linear: nn.Module, switch: "AdapterSwitch", path: str):
        super().__init__()
        self.linear = linear
        self._switch = switch  # plain attributes: not parameters of the model
        self._path = path

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        active = self._switch.active
        pair = active.layers.get(self._path) if active is not None else None
        if pair is None:
            return y
        a, b = pair
        z = (x @ a) @ b
        return y + (active.scale * z).astype(x.dtype)


def _dims(layer: nn.Module) -> tuple[int, int]:
    """(input, output) dims of a linear layer, quantized or not."""
    output_dims, input_dims = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        input_dims = input_dims * 32 // layer.bits
    return input_dims, output_dims


class AdapterSwitch:
    """The adapter the model computes with, and the wrappers that read it."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)  # never keeps an unloaded model alive
        self.active: AdapterWeights | None = None
        self.wrapped: set[str] = set()
        self.switches = 0

    def model(self) -> nn.Module | None:
        return self._model()

    def check(self, weights: AdapterWeights) -> None:
        """Refuses an adapter whose layers are not linear layers of this model with matching shapes."""
        modules = dict(self._model().named_modules())
        for path, (a, b) in weights.layers.items():
            module = modules.get(path)
            base = module.linear if isinstance(module, SwitchableLoRA) else module
            if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
                what = "no such module" if module is None else f"a {type(module).__name__}, not a linear layer"
                raise RequestError(400, "adapter_incompatible", f"Adapter '{weights.name}' targets '{path}': {what} "
                                   "in the loaded model", param="adapter_path")
            input_dims, output_dims = _dims(base)
            if a.shape[0] != input_dims or b.shape[1] != output_dims:
                raise RequestError(400, "adapter_incompatible",
                                   f"Adapter '{weights.name}' does not fit the loaded model at '{path}': LoRA "
                                   f"{a.shape[0]}->{b.shape[1]}, layer {input_dims}->{output_dims}",
                                   param="adapter_path")

    def install(self, weights: AdapterWeights) -> None:
        """Wraps the layers this adapter needs (once per layer; base weights are not touched)."""
        missing = [path for path in weights.layers if path not in self.wrapped]
        if not missing:
            return
        modules = dict(self._model().named_modules())
        self._model().update_modules(tree_unflatten([(p, SwitchableLoRA(modules[p], self, p)) for p in missing]))
        self.wrapped.update(missing)

    def activate(self, weights: AdapterWeights | None) -> None:
        if weights is self.active:
            return
        if weights is not None:
            self.install(weights)
        self.active = weights
        self.switches += 1


class BoundModel:
    """The model with one adapter (or none): what a generator calls instead of the model.

    Activates its adapter before every forward pass, so generators bound to different
    adapters can take turns on one model. Everything else is the model's.
    """

    def __init__(self, model: nn.Module, switch: AdapterSwitch, weights: AdapterWeights | None):
        self.model = model
        self.switch = switch
        self.weights = weights

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.switch.activate(self.weights)
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # layers, make_cache, args...
        if name in ("model", "switch", "weights"):  # not set yet (copying): never recurse
            raise AttributeError(name)
        return getattr(self.model, name)


# -- the engine's view ----------------------------------------------------------------------
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
        if not isinstance(spec, str):
            raise RequestError(400, "invalid_type", "'adapter' must be a string", param="adapter_path")
        if loaded.kind != "text":
            raise RequestError(400, "unsupported_adapter", f"Adapters are served for text models; '{loaded.ref.id}' "
                               f"is a {loaded.kind} model", param="adapter_path")
        name, path = self.registry.lookup(spec)
        try:
            return self._load(loaded, name, path).key
        except OSError as exc:
            raise RequestError(404, "adapter_not_found", f"Adapter '{spec}' could not be read: {exc}",
                               param="adapter_path") from None

    def _is_default_model(self, loaded: Any) -> bool:
        """`loaded` is --model (by directory: it may be served under --served-model-name or an alias)."""
        return loaded.ref.id == self.default_model or loaded.ref.path == self._default_model_path

    def add(self, args: dict[str, Any], loaded: Any) -> dict[str, Any]:
        """adapters.add {name, path}: registered, and checked against the loaded text model if any."""
        name, path = args.get("name"), args.get("path")
        if not isinstance(path, str):
            raise RequestError(400, "invalid_value", "'path' must be a string", param="path")
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
