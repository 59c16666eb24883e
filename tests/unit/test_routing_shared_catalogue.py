"""Several engines, one down: every worker answers alike, and a down engine holds up no live engine's model.

Red team after session 31: a worker gunicorn restarted after engine b died answered 503 for a model no
engine serves where the worker that survived (it had listed b) answered 404: the same request, two
answers. The workers of one master now share the catalogues they list through a directory the master
makes. A worker that never heard b also waited 2 s on b for every CALL it sent to each engine
(/v1/models, /health), and the first request naming a new spelling of a's model waited for b's answer
to `resolve_model` until b was taken as down (2 s) when b had just frozen.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from http_frontend.engine.client import EngineClient, EngineUnavailable
from http_frontend.engine.pool import EnginePool
from http_frontend.gunicorn_settings import SHARED_DIR_ENV, make_shared_dir, options, remove_shared_dir
from tests.unit.routing_fakes import Link, listed


def two_engines(shared: Path | None, b_alive: bool = True) -> tuple[EnginePool, dict[str, Link]]:
    links = {"a": Link("tiny-a", ["tiny-a"]), "b": Link("bee", ["bee", "tiny-b"], alive=b_alive)}
    return EnginePool(links, shared_dir=str(shared) if shared else None), links


def test_a_worker_started_after_an_engine_died_takes_its_catalogue_from_the_other_workers(tmp_path: Path) -> None:
    survivor, links = two_engines(tmp_path)
    listed(survivor)  # b up: listed, and written for the other workers
    links["b"].alive = False
    restarted, _ = two_engines(tmp_path, b_alive=False)
    listed(restarted)  # b down: this worker cannot list it
    for pool in (survivor, restarted):
        assert pool.catalogues.known("b")
        assert pool.serves_while_down("tiny-b") and pool.serves_while_down("bee")
        assert not pool.serves_while_down("never-served-anywhere")  # 404 from both workers alike
    message = restarted.outage_message("tiny-b")
    assert message is not None and "tiny-b" in message and "(b)" in message


def test_without_a_shared_catalogue_an_unlisted_down_engine_may_serve_any_model(tmp_path: Path) -> None:
    for shared in (None, tmp_path):  # no directory, or no worker ever listed b
        pool, _ = two_engines(shared, b_alive=False)
        listed(pool)
        assert not pool.catalogues.known("b")
        message = pool.outage_message("never-served-anywhere")
        assert message is not None and "may be served by engine b" in message and "not reachable" in message
        with pytest.raises(EngineUnavailable, match="may be served by engine b"):
            asyncio.run(pool.call("tokenize", {"model": "never-served-anywhere", "prompt": "hi"}))
        assert asyncio.run(pool.call("tokenize", {"model": "tiny-a", "prompt": "hi"}))["count"] == 2


def test_a_worker_lists_for_itself_once_the_engine_answers(tmp_path: Path) -> None:
    first, links = two_engines(tmp_path)
    listed(first)
    links["b"].ids = ["bee", "tiny-b", "new-b"]
    second, _ = two_engines(tmp_path)
    second.links["b"].ids = ["bee", "tiny-b", "new-b"]
    listed(second)  # b answers this worker: its own listing, shared in turn
    assert second.catalogues.lists("b", "new-b")
    links["b"].alive = False
    first.links["b"].epoch = 2  # a catalogue first listed itself is not replaced by the shared one
    listed(first)
    assert not first.catalogues.lists("b", "new-b")
    third, _ = two_engines(tmp_path, b_alive=False)
    listed(third)
    assert third.catalogues.lists("b", "new-b")


def test_an_unreadable_shared_catalogue_is_no_catalogue(tmp_path: Path) -> None:
    (tmp_path / "catalogue-b.json").write_text("{not json")
    pool, _ = two_engines(tmp_path, b_alive=False)
    listed(pool)
    assert not pool.catalogues.known("b") and pool.serves_while_down("anything")


def test_the_gunicorn_master_makes_the_shared_directory_and_removes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
    monkeypatch.delenv(SHARED_DIR_ENV + "_OWNED", raising=False)
    settings = options()
    assert settings["on_starting"] is make_shared_dir and settings["on_exit"] is remove_shared_dir
    make_shared_dir(None)
    made = Path(os.environ[SHARED_DIR_ENV])
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    remove_shared_dir(None)
    assert not made.exists()


OUTSTANDING = 30.0  # how long a test lets a request run while b's answer is held: far past SETTLE_SECONDS


def test_a_frozen_engine_holds_up_a_live_engines_model_only_briefly() -> None:
    """b froze a moment ago (not yet taken as down): a's model, by its name or another spelling, is answered
    while b's answer to `resolve_model` is still outstanding (the old code waited for every engine's answer)."""
    pool, links = two_engines(None)

    async def scenario(name: str) -> Any:
        links["b"].hold = asyncio.Event()  # b answers nothing until released
        request = asyncio.ensure_future(pool.call("tokenize", {"model": name, "prompt": "hi"}))
        await asyncio.wait({request}, timeout=OUTSTANDING)
        assert request.done(), f"{name}: the request waited for the frozen engine"
        links["b"].hold.set()
        return request.result()

    for name in ("tiny-a", "./tiny-a/"):
        assert asyncio.run(scenario(name))["count"] == 2
    assert pool.spellings.serves("a", "tiny-a", "./tiny-a/")


def test_a_late_answer_is_kept() -> None:
    """a has `bee/` loaded under that very name: b's answer is not awaited, yet kept when it comes."""
    pool, links = two_engines(None)
    links["a"].model = "bee/"

    async def scenario() -> None:
        links["b"].hold = asyncio.Event()
        learning = asyncio.ensure_future(pool.learn_model("bee/"))
        await asyncio.wait({learning}, timeout=OUTSTANDING)
        assert learning.done() and "resolve_model" in links["b"].calls, "learning waited for b's answer"
        assert not pool.spellings.serves("b", "bee", "bee/")
        links["b"].hold.set()
        for _ in range(1000):  # b's answer is recorded as it lands
            if pool.spellings.serves("b", "bee", "bee/"):
                break
            await asyncio.sleep(0.01)
        assert pool.spellings.serves("b", "bee", "bee/")
    asyncio.run(scenario())


def test_an_engine_that_never_answered_is_down_for_calls_after_its_silence() -> None:
    async def scenario() -> None:
        client = EngineClient("ipc:///nonexistent/mlx-test/never.sock", ping_interval=0.05, dead_after=0.2)
        await client.start()
        try:
            for _ in range(1000):
                if client.engine_state == "unreachable":
                    break
                await asyncio.sleep(0.01)
            assert client.engine_state == "unreachable"
            pending = client.call("status", timeout=5.0)
            try:  # refused in its first step: no wait for the engine at all (the old code waited 2 s)
                with pytest.raises(EngineUnavailable):
                    pending.send(None)
            finally:
                pending.close()
        finally:
            await client.close()
    asyncio.run(scenario())
