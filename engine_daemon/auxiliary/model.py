"""What an auxiliary model is, and the registry of the loaders of each kind.

Each kind's module (`embedding`, `transcription`, `speech`) registers its loader when
imported. `loader_for` imports a kind's module on first use, so the packages a kind needs
(mlx-embeddings, mlx-audio) load only when a model of that kind is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from engine_daemon.auxiliary.jobs import AuxiliaryJob

# kind -> the module of this package that registers its loader
KIND_MODULES: dict[str, str] = {
    "embedding": "engine_daemon.auxiliary.embedding",
    "transcription": "engine_daemon.auxiliary.transcription",
    "speech": "engine_daemon.auxiliary.speech",
}
KINDS = tuple(KIND_MODULES)


@runtime_checkable
class AuxiliaryModel(Protocol):
    """A loaded auxiliary model. Its MLX objects belong to the mlx thread."""

    kind: str  # "embedding" | "transcription" | "speech"
    name: str  # the name clients use
    path: str
    weight_bytes: int

    def close(self) -> None:
        """Drops the model's arrays (the slot frees MLX's cache after)."""

    def job(self, args: dict[str, Any]) -> AuxiliaryJob:
        """The work one request asks of this model (`AuxiliaryRequest.args`), run in slices by the worker."""


# (name clients use, resolved local directory) -> the loaded model. A loader may carry an
# `accepts(path: Path) -> bool` attribute: whether a directory holds a model of its kind (a name
# that does not reaches the kind's configured model, or a 400).
AuxiliaryLoader = Callable[[str, str], AuxiliaryModel]

_LOADERS: dict[str, AuxiliaryLoader] = {}


def register_loader(kind: str, loader: AuxiliaryLoader) -> None:
    """Called by a kind's module at import time."""
    if kind not in KIND_MODULES:
        raise ValueError(f"unknown auxiliary model kind {kind!r} (known: {', '.join(KINDS)})")
    _LOADERS[kind] = loader


def loader_for(kind: str) -> AuxiliaryLoader:
    """The loader of `kind`, importing its module on first use; LookupError when none exists."""
    if kind not in _LOADERS:
        module = KIND_MODULES.get(kind)
        if module is None:
            raise LookupError(f"unknown auxiliary model kind {kind!r}")
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise  # a dependency of the kind is missing: say which
            raise LookupError(f"no loader for {kind} models in this build") from None
    return _LOADERS[kind]


def weights_on_disk(path: str | Path) -> int:
    """Bytes of the safetensors of a model directory: its weights' size before loading it.

    The memory budget is checked against this before a load; after the load the
    model's own `weight_bytes` (its arrays' sizes) is what counts.
    """
    return sum(f.stat().st_size for f in Path(path).rglob("*.safetensors") if f.is_file())
