"""Where models come from: local directories and the Hugging Face cache.

Offline first: a name is looked up as a local directory, then in the local HF
cache; the Hub is asked only when downloads are allowed. Names from requests are
confined to the `--model-dir` roots and the HF cache (`resolve_request_model`). Nothing here imports mlx,
so the io thread can list models while the mlx thread is busy.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_daemon.config import MAX_NAME_BYTES

log = logging.getLogger(__name__)

# Files mlx_lm.load needs; fetched when a download is allowed.
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class ModelNotFound(LookupError):
    """The requested model is neither a local model directory nor in the HF cache."""


class InvalidModelName(ValueError):
    """A request's model name that could reach outside the model roots: refused before any lookup."""


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: the name clients use and the directory it loads from."""

    id: str
    path: Path


def is_mlx_model_dir(path: Path) -> bool:
    """A directory mlx-lm or mlx-vlm can load: a config naming a known architecture, plus safetensors."""
    config_file = path / "config.json"
    if not config_file.is_file() or not any(path.glob("*.safetensors")):
        return False
    try:
        config = json.loads(config_file.read_text())
        model_type = config.get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(model_type, str):
        return False
    # mlx-vlm also ships text-only, embedding and image-generation architectures: only its vision/audio
    # models count here (`load_vision_model` loads them).
    return (importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None or kind_of_config(config) != "text"
            or is_embedding_architecture(model_type) or is_speech_architecture(model_type))


def is_embedding_architecture(model_type: str) -> bool:
    """An encoder mlx-embeddings ships (bert, xlm-roberta, modernbert...): an embedding slot's model.

    Looked up on disk, as `_mlx_vlm_supports`: importing mlx_embeddings pulls in mlx-vlm.
    """
    spec = importlib.util.find_spec("mlx_embeddings")
    if spec is None or not spec.submodule_search_locations:
        return False
    name = model_type.lower().replace("-", "_")
    return any((Path(location) / "models" / f"{name}.py").is_file() for location in spec.submodule_search_locations)


def is_speech_architecture(model_type: str) -> bool:
    """Whisper or a text-to-speech architecture mlx-audio ships: a transcription or speech slot's model.

    Looked up on disk, as `is_embedding_architecture` (importing mlx_audio pulls in mlx).
    """
    spec = importlib.util.find_spec("mlx_audio")
    if spec is None or not spec.submodule_search_locations:
        return False
    name = model_type.lower().replace("-", "_")
    return name == "whisper" or any((Path(location) / "tts" / "models" / name / "__init__.py").is_file()
                                    for location in spec.submodule_search_locations)


# -- model kinds: which loader a model needs (`load_vision_model` for vision/audio) ---------
def _mlx_vlm_supports(model_type: str) -> bool:
    """mlx-vlm ships an architecture for `model_type` (found on disk: importing mlx_vlm is heavy)."""
    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None or not spec.submodule_search_locations:
        return False
    name = model_type.lower().replace("-", "_")
    return any((Path(location) / "models" / name / "__init__.py").is_file()
               for location in spec.submodule_search_locations)


def kind_of_config(config: dict) -> str:
    """"vision" for a config with a vision tower, "audio" for one with only an audio tower, else "text".

    Only architectures mlx-vlm knows count as vision/audio: anything else loads as text
    with mlx-lm (which also reads the text part of some VLM checkpoints).
    """
    model_type = config.get("model_type")
    if isinstance(model_type, str) and not importlib.util.find_spec(f"mlx_lm.models.{model_type}") \
            and is_speech_architecture(model_type):
        return "transcription" if model_type == "whisper" else "speech"  # auxiliary slots' models (mlx-audio)
    if not isinstance(model_type, str) or not _mlx_vlm_supports(model_type):
        return "text"
    if config.get("vision_config"):
        return "vision"
    if config.get("audio_config"):
        return "audio"
    return "text"


def model_kind(path: Path) -> str:
    """The kind of the model in directory `path` (see kind_of_config); "text" when unreadable."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "text"
    return kind_of_config(config) if isinstance(config, dict) else "text"


# -- context window: what /v1/models reports, read from config.json without loading the model ---------
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


def context_window_of(path: Path) -> int | None:
    """Tokens the model at `path` attends over (its config, or the text part of a VLM's); None when unknown."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return context_window_of_config(config) if isinstance(config, dict) else None


def context_window_of_config(config: dict) -> int | None:
    """The context window a parsed config.json declares (top level, or the text part of a VLM's)."""
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for key in _CONTEXT_KEYS:
        value = config.get(key) or text_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# Names the operator gave (--models-config aliases, --served-model-name): listed first in 404 notes.
_operator_names: tuple[str, ...] = ()


def set_operator_names(names: Sequence[str]) -> None:
    """Registers the operator's model names (`ModelNames`) for `available_note`."""
    global _operator_names
    _operator_names = tuple(names)


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve(name: str, allow_download: bool = False, roots: Sequence[Path] | None = None) -> ModelRef:
    """Maps a model name to a loadable directory, or raises ModelNotFound / InvalidModelName.

    `roots=None` is for names the operator typed (`--model`): any local directory,
    then the HF cache. A sequence (possibly empty) is for names that arrive in
    requests: confined to those roots and the HF cache, see `resolve_request_model`.
    """
    if roots is not None:
        return resolve_request_model(name, roots, allow_download)
    local = Path(name).expanduser()
    if local.is_dir():
        if is_mlx_model_dir(local):
            return ModelRef(id=name, path=local.resolve())
        raise ModelNotFound(f"'{name}' is a directory but not an MLX model")
    if not _looks_like_repo_id(name):
        raise ModelNotFound(f"The model '{name}' does not exist")
    return _from_hf_cache(name, allow_download)


# The Hub download in progress (repo id, monotonic start): the mlx thread blocks in it, and the
# io thread reports it in /health and the log (`EngineServer.loading`).
downloading: tuple[str, float] | None = None


def downloaded_bytes(repo_id: str) -> int:
    """Bytes of `repo_id` in the HF cache so far, partial downloads included (download progress)."""
    from huggingface_hub import constants

    blobs = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "blobs"
    try:
        return sum(entry.stat().st_size for entry in blobs.iterdir() if entry.is_file())
    except OSError:
        return 0


def _from_hf_cache(name: str, allow_download: bool, roots: Sequence[Path] | None = None) -> ModelRef:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(name, local_files_only=True, allow_patterns=MODEL_FILE_PATTERNS))
    except Exception:
        if not allow_download:
            raise ModelNotFound(
                f"The model '{name}' is not in the local Hugging Face cache and downloads are off"
                + ("" if roots is None else available_note(roots))
            ) from None
        log.info("downloading %s from the Hugging Face Hub", name)
        global downloading
        downloading = (name, time.monotonic())
        try:
            path = Path(snapshot_download(name, allow_patterns=MODEL_FILE_PATTERNS))
        except Exception as exc:
            raise ModelNotFound(f"The model '{name}' could not be downloaded: {exc}") from None
        finally:
            downloading = None
        log.info("downloaded %s (%.0f MiB)", name, downloaded_bytes(name) / 2**20)
    if not is_mlx_model_dir(path):
        raise ModelNotFound(f"The model '{name}' is not an MLX model")
    return ModelRef(id=name, path=path)


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    """`path` is one of the roots or below one (lexically: callers resolve first where it matters)."""
    return any(path == root or path.is_relative_to(root) for root in roots)


def resolve_request_model(name: str, roots: Sequence[Path], allow_download: bool = False) -> ModelRef:
    """A request's model name: a directory under a `--model-dir` root, or an HF repo id.

    Why so strict: the name comes from any HTTP client, and without a fence it
    could make the engine stat, read or even execute (remote code) files anywhere
    the engine's user can. So a name with a `..` component, or an absolute path
    that is not lexically under a root, is refused before the filesystem is
    touched; a path under a root must still resolve (symlinks followed) inside
    one. Roots must be absolute and resolved (`model_roots`).
    """
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InvalidModelName(f"Model names are limited to {MAX_NAME_BYTES} bytes")
    if not name.strip() or "\0" in name:
        raise InvalidModelName(f"'{name}' is not a valid model name")
    if ".." in name.replace("\\", "/").split("/"):
        raise InvalidModelName(f"The model name '{name}' may not contain '..'")
    expanded = os.path.expanduser(name) if name.startswith("~") else name
    if os.path.isabs(expanded):
        lexical = Path(os.path.normpath(expanded))
        if not _inside(lexical, roots):
            raise InvalidModelName(f"The model path '{name}' is outside the engine's model directories "
                                   "(--model-dir); name a model under one of them, or an HF repo id")
        candidates = [lexical]
    else:
        candidates = [root / name for root in roots]
    not_mlx = False
    for candidate in candidates:
        real = candidate.resolve()  # follows links; the result must still lie inside a root
        if not _inside(real, roots):
            raise InvalidModelName(f"The model '{name}' leads outside the engine's model directories")
        if real.is_dir():
            if is_mlx_model_dir(real):
                return ModelRef(id=name, path=real)
            not_mlx = True
    if not_mlx:
        raise ModelNotFound(f"'{name}' is a directory but not an MLX model" + available_note(roots))
    if os.path.isabs(expanded) or not _looks_like_repo_id(name):
        raise ModelNotFound(f"The model '{name}' does not exist" + available_note(roots))
    return _from_hf_cache(name, allow_download, roots)


def model_roots(dirs: Sequence[str | Path]) -> tuple[Path, ...]:
    """`--model-dir` values as absolute, resolved directories (so lexical checks compare like with like)."""
    return tuple(Path(d).expanduser().resolve() for d in dirs if str(d))


def list_root_models(roots: Sequence[Path]) -> list[dict]:
    """MLX model directories directly under each root, named relative to it (what a request sends)."""
    found: dict[str, dict] = {}
    for root in roots:
        try:
            children = sorted(root.iterdir())
        except OSError as exc:
            log.warning("cannot list --model-dir %s: %s", root, exc)
            continue
        for child in children:
            if child.name in found or not child.is_dir():
                continue
            real = child.resolve()
            if _inside(real, roots) and is_mlx_model_dir(real):
                found[child.name] = {"id": child.name, "created": int(child.stat().st_mtime), "path": str(real),
                                     "kind": model_kind(real), "context_window": context_window_of(real)}
    return list(found.values())


NO_MODELS_NOTE = ". No models are available in the engine's model directories or Hugging Face cache"


def available_note(roots: Sequence[Path], limit: int = 20) -> str:
    """'. Available models: a, b' for a 404, so a client can correct its request without asking the operator."""
    ids = list(dict.fromkeys([*_operator_names] + [m["id"] for m in list_root_models(roots)]
                             + [m["id"] for m in list_cached_models()]))
    if not ids:
        return NO_MODELS_NOTE
    more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
    return ". Available models: " + ", ".join(ids[:limit]) + more


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
            found.append({"id": repo.repo_id, "created": int(repo.last_modified), "path": str(newest.snapshot_path),
                          "kind": model_kind(Path(newest.snapshot_path)),
                          "context_window": context_window_of(Path(newest.snapshot_path))})
    found.sort(key=lambda m: (-m["created"], m["id"]))  # ties (same second) by id: a stable order
    return found

