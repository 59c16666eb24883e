"""CALLs that change model state: run by the mlx thread between two steps.

MLX objects (the model, adapter weights) belong to the mlx thread, so these
handlers are carried to it inside a `CallCommand` and run there. Each returns the events
it causes (an unload fails every running request) and its result.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Protocol

from engine_daemon.auxiliary.jobs import AuxiliaryQueue
from engine_daemon.auxiliary.slots import AuxiliarySlots
from engine_daemon.errors import RequestError
from engine_daemon.models.manager import ModelManager
from engine_daemon.scheduling.base import BaseScheduler, Event

log = logging.getLogger(__name__)

# Set to 1 (tests only) to enable CALLs that deliberately wedge the engine.
FAULT_INJECTION_ENV = "MLX_ENGINE_FAULT_INJECTION"

CallOutcome = tuple[list[Event], Any]


class MlxContext(Protocol):
    """What mlx-thread CALLs use: the worker (`MlxWorker`), seen through this interface."""

    scheduler: BaseScheduler
    models: ModelManager
    aux: AuxiliarySlots
    aux_jobs: AuxiliaryQueue


def unload(ctx: MlxContext, args: dict[str, Any]) -> CallOutcome:
    """Unloads the generation model and every auxiliary model; their requests in flight end with 503."""
    if getattr(ctx.scheduler, "lockstep", None) is not None:  # followers would keep their shards
        raise RequestError(400, "unsupported_in_group",
                           "An engine group keeps its model loaded; stop the group instead")
    events = ctx.scheduler.fail_all(503, "model_unloaded", "The model was unloaded")
    events += ctx.aux_jobs.fail(None, RequestError(503, "model_unloaded", "The model was unloaded",
                                                   error_type="server_error"))
    auxiliary = ctx.aux.unload()
    unloaded = ctx.models.unload()
    result: dict[str, Any] = {"status": "success" if unloaded or auxiliary else "no_model_loaded"}
    if auxiliary:
        result["auxiliary_unloaded"] = auxiliary  # the embedding / audio models' names
    return events, result


def adapters_add(ctx: MlxContext, args: dict[str, Any]) -> CallOutcome:
    return [], ctx.scheduler.adapters.add(args, ctx.models.current)


def adapters_remove(ctx: MlxContext, args: dict[str, Any]) -> CallOutcome:
    return [], ctx.scheduler.adapters.remove(args)


class InjectedCrash(BaseException):
    """Fault injection: escapes every per-command guard, as a bug in the mlx thread's own loop would."""


def debug_crash(ctx: MlxContext, args: dict[str, Any]) -> CallOutcome:
    """Fault injection for tests: kill the mlx thread (the engine must then exit non-zero)."""
    if os.environ.get(FAULT_INJECTION_ENV) != "1":
        return [], {"error": "unknown method debug_crash"}
    log.warning("fault injection: the mlx thread raises")
    raise InjectedCrash("fault injection: debug_crash")


def debug_sleep(ctx: MlxContext, args: dict[str, Any]) -> CallOutcome:
    """Fault injection for tests: wedge the mlx thread as a runaway kernel would."""
    if os.environ.get(FAULT_INJECTION_ENV) != "1":
        return [], {"error": "unknown method debug_sleep"}
    log.warning("fault injection: mlx thread sleeps %.1f s", args.get("seconds", 1.0))
    time.sleep(float(args.get("seconds", 1.0)))
    return [], {"slept": args.get("seconds", 1.0)}
