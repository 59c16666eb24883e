"""Adapter weights in memory and the switchable LoRA layers that apply them.

The base model stays loaded once; switching adapters is a pointer change.

The first adapter that touches a linear layer wraps it in a `SwitchableLoRA` (the base
layer stays inside, untouched); every wrapper reads the active adapter's
`lora_a`/`lora_b` from the model's `AdapterSwitch` while the forward pass is being
built. The arithmetic is mlx-lm's `LoRALinear` exactly.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine_daemon.errors import RequestError, describe
from engine_daemon.lora.registry import ADAPTER_WEIGHTS, file_version, read_adapter_config

log = logging.getLogger(__name__)


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


def load_adapter_weights(name: str, path: Path) -> AdapterWeights:
    """Reads an adapter from disk into lora_a/lora_b pairs per module path."""
    config = read_adapter_config(path)
    try:
        tensors = mx.load(str(path / ADAPTER_WEIGHTS))
    except Exception as exc:  # a corrupt file is the client's/operator's problem, not an engine failure
        raise RequestError(400, "invalid_adapter", f"Unreadable {ADAPTER_WEIGHTS}: {describe(exc)}") from None
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

    def __init__(self, linear: nn.Module, switch: AdapterSwitch, path: str):
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
