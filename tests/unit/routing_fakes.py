"""A stand-in engine link for the several-engines routing unit tests (`EnginePool` over fakes)."""

from __future__ import annotations

import asyncio
from typing import Any

from http_frontend.engine.client import EngineUnavailable
from http_frontend.engine.pool import EnginePool
from http_frontend.engine.request_stream import EngineError


class Link:
    """Lists `ids`, runs `ids` (or a path ending in its model) on its model and refuses the rest with 404, as an
    engine does; a down one is unreachable; while `hold` is set and not released, its CALLs wait for it."""

    def __init__(self, model: str, ids: list[str], alive: bool = True):
        self.frontend_id, self.streams, self.load, self.alive, self.engine_state = "f", {}, 0, alive, "ready"
        self.model, self.ids, self.epoch, self.calls = model, ids, 1, []
        self.hold: asyncio.Event | None = None

    @property
    def routable(self) -> bool:
        return self.alive and self.engine_state == "ready"

    async def call(self, method: Any, args: dict | None = None, timeout: float = 5.0) -> Any:
        if not self.alive:
            raise EngineUnavailable("The engine is not reachable")
        self.calls.append(method)
        if self.hold is not None:
            await self.hold.wait()
        if method == "list_models":
            return [{"id": model_id} for model_id in self.ids]
        model = (args or {}).get("model")
        if not (model in self.ids or str(model).rstrip("/").endswith(self.model)):
            raise EngineError({"status": 404, "code": "model_not_found", "message": f"no model {model!r}"})
        if method == "resolve_model":
            return {"id": self.model, "loaded": True}
        return {"tokens": [1, 2], "count": 2}


def listed(pool: EnginePool) -> None:
    """One round of the pool's catalogue listing, to its end."""
    async def one_round() -> None:
        started = pool.catalogues.refresh()
        if started:
            await asyncio.wait(started)
    asyncio.run(one_round())
