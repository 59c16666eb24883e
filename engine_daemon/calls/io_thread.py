"""CALLs the io thread answers at once, from values the mlx thread publishes (never waiting on it).

Status, the model catalogue, stats, the adapter list and the Responses store are read
here so that /health, /v1/models and /stats answer during a long prefill or a model load.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from engine_daemon.auxiliary.embedding import pooling_of
from engine_daemon.calls import response_store
from engine_daemon.calls.response_store import ResponseStore
from engine_daemon.generation.speculative import speculative_stats
from engine_daemon.models.store import list_cached_models, list_root_models
from engine_daemon.request.preprocess import Preprocessor
from engine_daemon.scheduling.worker import MlxWorker


class IoContext(Protocol):
    """What io-thread CALLs read: the engine server (`EngineServer`), seen through this interface."""

    epoch: int
    started_at: float
    peers: dict[bytes, Any]
    worker: MlxWorker
    responses: ResponseStore
    preprocessor: Preprocessor

    def state(self) -> str: ...

    def loading(self) -> dict[str, Any]: ...


def status(ctx: IoContext, args: dict[str, Any]) -> dict[str, Any]:
    worker_status = ctx.worker.status
    busy = time.monotonic() - worker_status.busy_since if worker_status.busy_since else 0.0
    return {"epoch": ctx.epoch, "state": ctx.state(), "busy_seconds": busy, "model": worker_status.model,
            "model_kind": worker_status.model_kind,
            "adapter": ctx.worker.scheduler.adapters.registry.default,  # --adapter-path's name
            "queued": worker_status.queued, "running": worker_status.running, "pid": os.getpid(),
            "host": socket.gethostname(), "started_at": ctx.started_at,
            "uptime": time.time() - ctx.started_at, "model_loads": ctx.worker.models.loads,
            "auxiliary_models": ctx.worker.aux.describe(), **ctx.loading(),
            # Engine groups: mode, size, backend, per-rank memory, and which rank failed (`GroupLeader`).
            **({"group": ctx.worker.group.describe()} if ctx.worker.group is not None else {})}


def list_models(ctx: IoContext, args: dict[str, Any]) -> list[dict[str, Any]]:
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


def stats(ctx: IoContext, args: dict[str, Any]) -> dict[str, Any]:
    scheduler = ctx.worker.scheduler
    return {**status(ctx, args), "frontends": len(ctx.peers), "steps": ctx.worker.status.steps,
            "batch_size": ctx.worker.status.running, **scheduler.describe(), **scheduler.stats.as_dict(),
            **scheduler.prompt_cache_stats(), **ctx.responses.stats(), **scheduler.adapters.stats(),
            **ctx.preprocessor.stats(), **ctx.worker.aux_jobs.stats(), "auxiliary_loads": ctx.worker.aux.loads,
            "auxiliary_work": ctx.worker.aux.counters(),
            **speculative_stats(scheduler.speculative, ctx.worker.status.model)}


def step_gaps(ctx: IoContext, args: dict[str, Any]) -> dict[str, Any]:
    """The engine's own per-token timing: gaps between consecutive decode steps (benchmarks read it)."""
    worker = ctx.worker
    count, gaps = worker.step_gap_count, list(worker.step_gaps)
    return {"count": count, "gaps_ms": [round(gap * 1000, 3) for gap in gaps]}


def adapters_list(ctx: IoContext, args: dict[str, Any]) -> dict[str, Any]:
    """A snapshot the mlx thread replaces on every change of the registry."""
    return {"data": ctx.worker.scheduler.adapters.registry.snapshot}


def responses_put(ctx: IoContext, args: dict[str, Any]) -> Any:
    return response_store.put(ctx.responses, args)


def responses_get(ctx: IoContext, args: dict[str, Any]) -> Any:
    return response_store.get(ctx.responses, args)


def responses_delete(ctx: IoContext, args: dict[str, Any]) -> Any:
    return response_store.delete(ctx.responses, args)
