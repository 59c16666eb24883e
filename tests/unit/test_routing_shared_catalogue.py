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
import time
from pathlib import Path
from typing import Any

import pytest

from http_frontend.engine.client import EngineClient, EngineUnavailable
from http_frontend.engine.model_names import SETTLE_SECONDS
from http_frontend.engine.pool import EnginePool
from http_frontend.engine.request_stream import EngineError
from http_frontend.gunicorn_settings import SHARED_DIR_ENV, make_shared_dir, options, remove_shared_dir


class Link:
    """A stand-in engine: lists `ids`, runs `ids` on its model, refuses the rest with 404; `frozen` never answers."""

    def __init__(self, model: str, ids: list[str], alive: bool = True):
        self.frontend_id, self.streams, self.load, self.alive, self.engine_state = "f", {}, 0, alive, "ready"
        self.model, self.ids, self.epoch, self.frozen = model, ids, 1, False

    @property
    def routable(self) -> bool:
        return self.alive and self.engine_state == "ready"

    async def call(self, method: Any, args: dict | None = None, timeout: float = 5.0) -> Any:
        if not self.alive:
            raise EngineUnavailable("The engine is not reachable")
        if self.frozen:
            await asyncio.sleep(timeout)
            raise EngineUnavailable("The engine did not answer")
        if method == "list_models":
            return [{"id": model_id} for model_id in self.ids]
        model = (args or {}).get("model")
        known = model in self.ids or str(model).rstrip("/").endswith(self.model)
        if not known:
            raise EngineError({"status": 404, "code": "model_not_found", "message": f"no model {model!r}"})
        if method == "resolve_model":
            return {"id": self.model, "loaded": True}
        return {"tokens": [1, 2], "count": 2}


def listed(pool: EnginePool) -> None:
    async def one_round() -> None:
        started = pool.catalogues.refresh()
        if started:
            await asyncio.wait(started)
    asyncio.run(one_round())


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


def test_a_frozen_engine_holds_up_a_live_engines_model_only_briefly() -> None:
    """b froze a moment ago (not yet taken as down): a's model, by its name or another spelling, goes on."""
    pool, links = two_engines(None)
    links["b"].frozen = True

    async def timed(name: str) -> tuple[float, Any]:
        started = time.monotonic()
        answer = await pool.call("tokenize", {"model": name, "prompt": "hi"})
        return time.monotonic() - started, answer

    for name in ("tiny-a", "./tiny-a/"):
        took, answer = asyncio.run(timed(name))
        assert answer["count"] == 2 and took < SETTLE_SECONDS + 0.5, (name, took)
    assert pool.spellings.serves("a", "tiny-a", "./tiny-a/")


def test_a_late_answer_is_kept() -> None:
    """a has `bee/` loaded under that very name: b's slower answer is not awaited, yet kept when it comes."""
    pool, links = two_engines(None)
    links["a"].model = "bee/"
    answer_b = links["b"].call

    async def late(method: Any, args: dict | None = None, timeout: float = 5.0) -> Any:
        await asyncio.sleep(0.6)
        return await answer_b(method, args, timeout)
    links["b"].call = late  # type: ignore[method-assign]

    async def scenario() -> None:
        started = time.monotonic()
        await pool.learn_model("bee/")
        assert time.monotonic() - started < 0.5
        assert not pool.spellings.serves("b", "bee", "bee/")
        await asyncio.sleep(0.8)
        assert pool.spellings.serves("b", "bee", "bee/")
    asyncio.run(scenario())


def test_an_engine_that_never_answered_is_down_for_calls_after_its_silence() -> None:
    async def scenario() -> None:
        client = EngineClient("ipc:///nonexistent/mlx-test/never.sock", ping_interval=0.05, dead_after=0.2)
        await client.start()
        try:
            await asyncio.sleep(0.5)
            assert client.engine_state == "unreachable"
            started = time.monotonic()
            with pytest.raises(EngineUnavailable):
                await client.call("status", timeout=5.0)
            assert time.monotonic() - started < 0.1
        finally:
            await client.close()
    asyncio.run(scenario())
