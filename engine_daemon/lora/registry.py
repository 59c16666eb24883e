"""Where LoRA adapters come from: registered names, directories confined to the model roots.

Requests name an adapter by a registered name or by a directory inside the `--model-dir`
roots: like model names, paths from clients are confined to those roots, never any path
(`resolve_adapter_dir`). Nothing here imports mlx: the io thread reads
`AdapterRegistry.snapshot` for `adapters.list` (it is replaced, never mutated), and
`engined` checks `--adapter-path` before MLX loads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_daemon.config import MAX_NAME_BYTES
from engine_daemon.errors import RequestError, describe

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")



# -- where adapters come from ---------------------------------------------------------------
def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def resolve_adapter_dir(spec: str, roots: Sequence[Path], param: str = "adapter_path") -> Path:
    """An adapter directory a client named, confined to the model roots (as `resolve` confines models).

    Refused before the filesystem is touched: `..` components and absolute paths not
    lexically under a root. A path under a root must still resolve (links followed) inside one.
    """
    if len(spec.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise RequestError(400, "invalid_adapter", f"Adapter names are limited to {MAX_NAME_BYTES} bytes",
                           param=param)
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
    """Changes when the adapter's weights file is rewritten (part of the cache key): its ctime and inode too,
    so a rewrite whose mtime was put back (`touch -d`) is still a new version."""
    stat = (path / ADAPTER_WEIGHTS).stat()
    return f"{stat.st_mtime_ns}-{stat.st_size}-{stat.st_ino}-{stat.st_ctime_ns}"


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


# -- what an adapter directory holds ---------------------------------------------------------
def read_adapter_config(path: Path, param: str = "adapter_path") -> dict[str, Any]:
    """adapter_config.json, checked for what this engine can switch (LoRA on linear layers)."""
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise RequestError(400, "invalid_adapter", f"Unreadable {ADAPTER_CONFIG}: {describe(exc)}",
                           param=param) from None
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
