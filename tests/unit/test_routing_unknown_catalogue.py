"""A worker that never had a down engine's catalogue, and CALLs naming a down engine's model.

Session 30 left two gaps: a gunicorn worker started after engine b died never listed b's models, so
it answered engine a's 404 for b's model where the other workers answered 503; and `/v1/tokenize` or
`count_tokens` naming b's model got a's 404 on every worker, where generation got 503.
"""

from __future__ import annotations

import asyncio

import pytest

from http_frontend.engine.client import EngineUnavailable
from http_frontend.engine.pool import EnginePool
from http_frontend.engine.request_stream import EngineError
from tests.unit.routing_fakes import Link, listed


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
