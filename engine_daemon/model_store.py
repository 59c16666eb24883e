"""Where models come from: local directories and the Hugging Face cache.

Offline first: a name is looked up as a local directory, then in the local HF
cache; the Hub is asked only when downloads are allowed. Nothing here imports mlx,
so the io thread can list models while the mlx thread is busy.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Files mlx_lm.load needs; fetched when a download is allowed.
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class ModelNotFound(LookupError):
    """The requested model is neither a local model directory nor in the HF cache."""


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: the name clients use and the directory it loads from."""

    id: str
    path: Path


def is_mlx_model_dir(path: Path) -> bool:
    """A directory mlx-lm can load: a config naming a known architecture, plus safetensors."""
    config_file = path / "config.json"
    if not config_file.is_file() or not any(path.glob("*.safetensors")):
        return False
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    if not isinstance(model_type, str):
        return False
    return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve(name: str, allow_download: bool = False) -> ModelRef:
    """Maps a request's model name to a loadable directory, or raises ModelNotFound."""
    local = Path(name).expanduser()
    if local.is_dir():
        if is_mlx_model_dir(local):
            return ModelRef(id=name, path=local.resolve())
        raise ModelNotFound(f"'{name}' is a directory but not an MLX model")
    if not _looks_like_repo_id(name):
        raise ModelNotFound(f"The model '{name}' does not exist")
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(name, local_files_only=True, allow_patterns=MODEL_FILE_PATTERNS))
    except Exception:
        if not allow_download:
            raise ModelNotFound(
                f"The model '{name}' is not in the local Hugging Face cache and downloads are off"
            ) from None
        log.info("downloading %s from the Hugging Face Hub", name)
        try:
            path = Path(snapshot_download(name, allow_patterns=MODEL_FILE_PATTERNS))
        except Exception as exc:
            raise ModelNotFound(f"The model '{name}' could not be downloaded: {exc}") from None
    if not is_mlx_model_dir(path):
        raise ModelNotFound(f"The model '{name}' is not an MLX model")
    return ModelRef(id=name, path=path)


def list_cached_models() -> list[dict]:
    """MLX models in the local HF cache (HF_HUB_CACHE / HF_HOME honoured), newest first."""
    from huggingface_hub import scan_cache_dir

    try:
        cache = scan_cache_dir()
    except Exception as exc:  # no cache dir yet, unreadable cache...
        log.debug("no Hugging Face cache to scan: %s", exc)
        return []
    found = []
    for repo in cache.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        if is_mlx_model_dir(Path(newest.snapshot_path)):
            found.append({"id": repo.repo_id, "created": int(repo.last_modified), "path": str(newest.snapshot_path)})
    found.sort(key=lambda m: -m["created"])
    return found

