"""Draining: the engine says `draining` in every PONG so that front-ends route no new work to it.

For rolling restarts and model upgrades behind several front-end workers (and
hosts): one CALL (`drain`, from `POST /admin/engines/{id}/drain`) or a signal to
the engine (SIGUSR1 drains, SIGUSR2 undrains) reaches every front-end within a
ping, where a flag in one front-end worker would reach only that worker. A drain
is soft: requests that were already on their way are still admitted and every
open stream runs to its end; only the routers stop choosing this engine. Stop it
(SIGTERM) once `queued` and `running` are 0.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Drainable(Protocol):
    draining: bool


def drain(ctx: Drainable, args: dict[str, Any]) -> dict[str, Any]:
    """CALL drain {"draining": bool (default true)}: set or clear the flag; answers the new value."""
    draining = args.get("draining", True)
    if not isinstance(draining, bool):
        draining = True
    if draining != ctx.draining:
        log.info("%s", "draining: front-ends send no new requests; open streams finish"
                 if draining else "drain ended: taking new requests")
    ctx.draining = draining
    return {"draining": draining}


def install_signals(ctx: Drainable) -> None:
    """SIGUSR1 drains, SIGUSR2 undrains (main thread only, as `signal` requires)."""
    signal.signal(signal.SIGUSR1, lambda *_: drain(ctx, {"draining": True}))
    signal.signal(signal.SIGUSR2, lambda *_: drain(ctx, {"draining": False}))
