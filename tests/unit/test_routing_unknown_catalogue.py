"""A worker that never had a down engine's catalogue, and CALLs naming a down engine's model.

Session 30 left two gaps: a gunicorn worker started after engine b died never listed b's models, so
it answered engine a's 404 for b's model where the other workers answered 503; and `/v1/tokenize` or
`count_tokens` naming b's model got a's 404 on every worker, where generation got 503.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from http_frontend.engine.client import EngineUnavailable
from http_frontend.engine.pool import EnginePool
from http_frontend.engine.request_stream import EngineError


class Link:
    """A stand-in engine client: lists `ids`, refuses other models' tokenize CALLs with 404 as an engine does."""

    def __init__(self, model: str, ids: list[str], alive: bool = True):
        self.frontend_id, self.streams, self.load, self.alive, self.engine_state = "f", {}, 0, alive, "ready"
        self.model, self.ids, self.epoch, self.calls = model, ids, 1, []

    @property
    def routable(self) -> bool:
        return self.alive and self.engine_state == "ready"

    async def call(self, method: Any, args: dict | None = None, timeout: float = 5.0) -> Any:
        if not self.alive:
            raise EngineUnavailable("The engine is not reachable")
        self.calls.append(method)
        if method == "list_models":
            return [{"id": model_id} for model_id in self.ids]
        if method == "resolve_model":
            return {"model": None}
        model = (args or {}).get("model")
        if model not in self.ids:
            raise EngineError({"status": 404, "code": "model_not_found", "message": f"no model {model!r}"})
        return {"tokens": [1, 2], "count": 2}


def listed(pool: EnginePool) -> None:
    async def one_round() -> None:
        started = pool.catalogues.refresh()
        if started:
            await asyncio.wait(started)
    asyncio.run(one_round())


def test_an_engine_never_listed_may_serve_any_model_while_it_is_down() -> None:
    links = {"a": Link("tiny-a", ["tiny-a"]), "b": Link("bee", ["bee", "tiny-b"], alive=False)}
    pool = EnginePool(links)
    listed(pool)  # b is down: only a is listed (a worker started after b died)
    assert pool.catalogues.known("a") and not pool.catalogues.known("b")
    for name in ("bee", "tiny-b", "never-served-anywhere"):
        assert pool.serves_while_down(name), name
    links["b"].alive = True
    listed(pool)
    links["b"].alive = False
    assert pool.serves_while_down("tiny-b") and not pool.serves_while_down("never-served-anywhere")


def test_every_engine_answered_an_unknown_model_is_still_a_404() -> None:
    pool = EnginePool({"a": Link("tiny-a", ["tiny-a"]), "b": Link("bee", ["bee"])})
    listed(pool)
    assert not pool.serves_while_down("never-served-anywhere")


@pytest.mark.parametrize("catalogued", [True, False])
def test_a_call_naming_a_down_engines_model_is_its_outage(catalogued: bool) -> None:
    links = {"a": Link("tiny-a", ["tiny-a"]), "b": Link("bee", ["bee", "tiny-b"])}
    pool = EnginePool(links)
    if catalogued:
        listed(pool)
    links["b"].alive = False
    with pytest.raises(EngineUnavailable, match="tiny-b"):
        asyncio.run(pool.call("tokenize", {"model": "tiny-b", "prompt": "hi"}))
    assert asyncio.run(pool.call("tokenize", {"model": "tiny-a", "prompt": "hi"}))["count"] == 2


def test_a_call_for_a_model_no_engine_lists_keeps_the_engines_404() -> None:
    links = {"a": Link("tiny-a", ["tiny-a"]), "b": Link("bee", ["bee"])}
    pool = EnginePool(links)
    listed(pool)
    links["b"].alive = False
    with pytest.raises(EngineError):
        asyncio.run(pool.call("tokenize", {"model": "never-served-anywhere", "prompt": "hi"}))
