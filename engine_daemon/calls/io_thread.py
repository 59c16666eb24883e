"""CALLs the io thread answers at once, from values the mlx thread publishes (never waiting on it).

Status, stats, the adapter list and the Responses store are read here so that /health and
/stats answer during a long prefill or a model load. The model catalogue reads the disk: it has
a thread of its own (`calls.catalogue`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Protocol

from engine_daemon.calls import response_store
from engine_daemon.calls.response_store import ResponseStore
from engine_daemon.generation.speculative import speculative_stats
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
