"""The `list_models` CALL: the model catalogue, read from the disk on a thread of its own, reused for a few seconds.

It scans the operator's names, --model-dir and the Hugging Face cache (and reads each text model's
files for its pooling): on the io thread, a slow disk or a huge cache stalled every stream's frames,
and every front-end worker asks every engine for it at its start and every 10 minutes. It runs on
the engine's disk-calls thread (`transport.disk_calls`, which never waits on the mlx thread either),
and a scan is reused for `CATALOGUE_TTL` seconds while the loaded models stay the same, so workers
asking at once cost one scan. A model loaded or unloaded meanwhile is seen at once; a model put on
the disk within `CATALOGUE_TTL`.
"""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path
from typing import Any

from engine_daemon.auxiliary.embedding import pooling_of
from engine_daemon.calls.io_thread import IoContext
from engine_daemon.models.store import list_cached_models, list_root_models

CATALOGUE_TTL = 5.0  # seconds a scan answers `list_models` (its key is the engine's state, nothing a client sends)

_lock = threading.Lock()  # one scan at a time: callers arriving meanwhile take its result
_cache: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, Any], float, list[dict[str, Any]]]] = (
    weakref.WeakKeyDictionary())  # engine server -> (its state, when scanned, the catalogue)


def _state(ctx: IoContext) -> tuple[Any, Any]:
    """What the catalogue shows besides the disk: the loaded model (one load of it) and the auxiliary models'
    published snapshot (replaced, never mutated, on each of their loads and unloads: compared by identity)."""
    current = ctx.worker.models.current
    return (current.ref.id, current.loaded_at) if current is not None else None, ctx.worker.aux.snapshot


def list_models(ctx: IoContext, args: dict[str, Any]) -> list[dict[str, Any]]:
    """The catalogue (`scan`), reused for `CATALOGUE_TTL` seconds while the loaded models stay the same."""
    with _lock:
        state = _state(ctx)
        cached = _cache.get(ctx)
        if (cached is not None and cached[0][0] == state[0] and cached[0][1] is state[1]
                and time.monotonic() - cached[1] < CATALOGUE_TTL):
            return cached[2]
        models = scan(ctx)
        _cache[ctx] = (state, time.monotonic(), models)
        return models


def scan(ctx: IoContext) -> list[dict[str, Any]]:
    """The catalogue: the operator's names, models under --model-dir, the HF cache, and the loaded model.

    In that order, as names resolve. `loaded` marks every id a request could name
    without a load: the loaded name, and ids whose directory is served under it.
    """
    names = ctx.worker.models.names
    models = names.catalogue()
    for found in (list_root_models(ctx.worker.scheduler.config.model_dirs), list_cached_models()):
        seen = {m["id"] for m in models}
        models += [m for m in found if m["id"] not in seen]
    current = ctx.worker.models.current  # one read: the mlx thread may swap it meanwhile
    loaded = current.ref.id if current else None
    if current is not None and loaded not in {m["id"] for m in models}:
        models.insert(0, {"id": loaded, "created": int(current.loaded_at), "kind": current.kind})
    auxiliary = ctx.worker.aux.catalogue()  # loaded or configured (--embedding-model and the like), typed by kind
    aux_dirs = ctx.worker.aux.loaded_dirs()
    for entry in models:
        path = entry.pop("path", None)
        if entry.get("kind", "text") == "text" and path and pooling_of(Path(path)):
            entry["kind"] = "embedding"  # served by /v1/embeddings in the embedding slot, not as a chat model
        served_as = entry["id"] if entry["id"] in names.entries else names.name_of_path(path) or entry["id"]
        # As `BaseScheduler.resolve_model` folds them: an unnamed spelling of the loaded directory is the loaded model
        # (and one of a loaded auxiliary model's directory is served by its slot without a load).
        unnamed = bool(path) and entry["id"] not in names.entries
        chat = served_as == loaded or (unnamed and current is not None and loaded not in names.entries
                                       and _same_dir(path, current.ref.path))
        entry["loaded"] = chat or (unnamed and any(_same_dir(path, directory) for directory in aux_dirs))
        if chat:
            entry["context_window"] = current.context_window  # as loaded: a profile may override it
    aux_ids = {entry["id"] for entry in auxiliary}
    return auxiliary + [m for m in models if m["id"] not in aux_ids]


def _same_dir(a: str | Path, b: str | Path) -> bool:
    """Two spellings of one directory (relative, symlinked, trailing slash)."""
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
