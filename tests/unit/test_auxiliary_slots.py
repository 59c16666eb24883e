"""The auxiliary slot framework with a stand-in loader: loads, names, budget, idle unload, job slices.

Real models are served in tests/stack/test_embeddings.py; here the rules of the slots and
of the job queue are checked without MLX work.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from engine_daemon.auxiliary import model as aux_model
from engine_daemon.auxiliary.jobs import (
    FIRST_BUDGET,
    GAP_SHARE,
    IDLE_BUDGET,
    MIN_BUDGET,
    AuxiliaryJob,
    AuxiliaryQueue,
    AuxiliaryRequest,
)
from engine_daemon.auxiliary.slots import AuxiliarySlots
from engine_daemon.calls import mlx_thread
from engine_daemon.config import SchedulerConfig
from engine_daemon.errors import RequestError
from engine_daemon.models.names import ModelNames
from engine_daemon.scheduling.commands import AuxiliaryCommand
from engine_daemon.scheduling.worker import MlxWorker
from protocol import MsgType


class FakeJob(AuxiliaryJob):
    kind = "embedding"

    def __init__(self, slices: int, prepared: list[str]):
        self.left = slices
        self.prepared = prepared
        self.budgets: list[int] = []

    def prepare(self) -> None:
        self.prepared.append("prepared")

    def step(self, budget: int) -> bool:
        self.budgets.append(budget)
        self.left -= 1
        return self.left <= 0

    def finished(self) -> bool:
        return self.left <= 0

    def result(self) -> Any:
        return {"slices": len(self.budgets)}


class FakeModel:
    kind = "embedding"

    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        self.weight_bytes = aux_model.weights_on_disk(path)
        self.closed = False
        self.prepared: list[str] = []

    def close(self) -> None:
        self.closed = True

    def job(self, args: dict[str, Any]) -> FakeJob:
        return FakeJob(args.get("slices", 1), self.prepared)


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[FakeModel]:
    made: list[FakeModel] = []

    def loader(name: str, path: str) -> FakeModel:
        made.append(FakeModel(name, path))
        return made[-1]

    monkeypatch.setitem(aux_model._LOADERS, "embedding", loader)
    return made


def model_dir(root: Path, name: str, size: int) -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (path / "model.safetensors").write_bytes(b"\0" * size)
    return path


def slots(root: Path, **kwargs: Any) -> AuxiliarySlots:
    return AuxiliarySlots(ModelNames(), roots=(root,), accepts=lambda kind, path: "chat" not in path.name, **kwargs)


def test_loads_on_first_use_and_reuses(tmp_path: Path, loaded: list[FakeModel]) -> None:
    model_dir(tmp_path, "bert-a", 100)
    aux = slots(tmp_path)
    first = aux.get("embedding", "bert-a")
    assert aux.get("embedding", "bert-a") is first and aux.get("embedding", None) is first
    assert aux.loads == 1 and len(loaded) == 1
    [entry] = aux.describe()
    assert entry["kind"] == "embedding" and entry["name"] == "bert-a" and entry["weight_bytes"] == 100
    assert entry["loaded_at"] <= time.time() and entry["last_used"] >= entry["loaded_at"]
    assert aux.catalogue() == [{"id": "bert-a", "created": int(entry["loaded_at"]), "kind": "embedding",
                                "loaded": True}]


def test_another_name_of_the_kind_replaces_the_model(tmp_path: Path, loaded: list[FakeModel]) -> None:
    model_dir(tmp_path, "bert-a", 10)
    model_dir(tmp_path, "bert-b", 10)
    aux = slots(tmp_path)
    a = aux.get("embedding", "bert-a")
    b = aux.get("embedding", "bert-b")
    assert a.closed and not b.closed and [m["name"] for m in aux.describe()] == ["bert-b"]


def test_names_fall_back_to_the_configured_model_or_fail_clearly(tmp_path: Path, loaded: list[FakeModel]) -> None:
    model_dir(tmp_path, "bert-a", 10)
    model_dir(tmp_path, "chat", 10)
    configured = slots(tmp_path, preload={"embedding": str(tmp_path / "bert-a")})
    assert configured.get("embedding", "text-embedding-3-small").path == str((tmp_path / "bert-a").resolve())
    assert configured.get("embedding", "chat").name == str(tmp_path / "bert-a")  # a chat model is not one
    bare = slots(tmp_path)
    with pytest.raises(RequestError) as missing:
        bare.get("embedding", "text-embedding-3-small")
    assert missing.value.status == 404 and missing.value.code == "model_not_found"
    with pytest.raises(RequestError) as wrong_kind:
        bare.get("embedding", "chat")
    assert wrong_kind.value.status == 400 and "not a model of kind 'embedding'" in str(wrong_kind.value)
    with pytest.raises(RequestError) as unnamed:
        bare.get("embedding", None)
    assert unnamed.value.status == 400 and unnamed.value.code == "model_required"


def test_memory_budget_counts_the_main_model_and_the_other_slots(tmp_path: Path, loaded: list[FakeModel]) -> None:
    model_dir(tmp_path, "bert-a", 600)
    aux = slots(tmp_path, memory_budget_bytes=1000, main_weight_bytes=lambda: 500)
    with pytest.raises(RequestError) as refused:
        aux.get("embedding", "bert-a")
    assert refused.value.status == 400 and refused.value.code == "memory_budget_exceeded"
    assert loaded == [] and aux.describe() == []  # refused before loading
    fits = slots(tmp_path, memory_budget_bytes=1200, main_weight_bytes=lambda: 500)
    assert fits.get("embedding", "bert-a").weight_bytes == 600


def test_idle_unload_and_unload(tmp_path: Path, loaded: list[FakeModel]) -> None:
    model_dir(tmp_path, "bert-a", 10)
    aux = slots(tmp_path)
    model = aux.get("embedding", "bert-a")
    assert aux.unload_idle(time.monotonic(), 60) == []
    assert aux.unload_idle(time.monotonic() + 61, 60) == ["bert-a"] and model.closed
    assert aux.describe() == [] and aux.unload() == []


def test_queue_runs_one_slice_per_tick_and_answers_finished_jobs() -> None:
    queue = AuxiliaryQueue(fixed=7)
    long, short = FakeJob(3, []), FakeJob(1, [])
    queue.add(b"p", "c1", long)
    queue.add(b"p", "c2", short)
    assert queue.tick() == [] and queue.tick() == []
    assert queue.tick() == [(b"p", MsgType.RESULT, {"cid": "c1", "result": {"slices": 3}})]
    assert long.budgets == [7, 7, 7] and short.budgets == []  # the head job only
    assert queue.tick() == [(b"p", MsgType.RESULT, {"cid": "c2", "result": {"slices": 1}})]
    assert not queue.has_work()


def test_slices_are_sized_from_measured_costs_unless_fixed() -> None:
    queue = AuxiliaryQueue()
    assert queue.slice_budget(None) == IDLE_BUDGET  # nothing decodes: nobody to slow down
    assert queue.slice_budget(0.1) == FIRST_BUDGET  # no measure yet
    queue._observe(0.064, 64)  # 1 ms per token
    assert queue.slice_budget(0.1) == int(GAP_SHARE * 100)  # 0.8 of a 100 ms decode step
    assert queue.slice_budget(0.001) == MIN_BUDGET and queue.slice_budget(100.0) == IDLE_BUDGET
    assert AuxiliaryQueue(fixed=300).slice_budget(0.1) == 300


def test_queue_fails_a_raising_job_alone() -> None:
    class Broken(FakeJob):
        def step(self, budget: int) -> bool:
            raise RuntimeError("boom")

    queue = AuxiliaryQueue()
    queue.add(b"p", "bad", Broken(1, []))
    queue.add(b"p", "good", FakeJob(1, []))
    [(peer, kind, body)] = queue.tick()
    assert kind is MsgType.ERROR and body["cid"] == "bad" and body["status"] == 500
    assert queue.tick()[0][2]["cid"] == "good"


def test_worker_serves_auxiliary_calls_without_touching_the_generation_model(
        tmp_path: Path, loaded: list[FakeModel]) -> None:
    model_dir(tmp_path, "bert-a", 10)
    context = zmq.Context()
    try:
        worker = MlxWorker(context, "inproc://unused", SchedulerConfig(model_dirs=(tmp_path,)))
        worker.aux.accepts = lambda kind, path: True
        request = AuxiliaryRequest("embedding", "bert-a", {"slices": 2})
        assert worker._handle(AuxiliaryCommand(b"p", "c1", request)) == []
        ready = worker.commands.get_nowait()  # prepared in line (no pool in this test)
        assert loaded[0].prepared == ["prepared"]
        assert worker._handle(ready) == [] and worker.aux_jobs.has_work()
        assert worker.aux_jobs.tick() == []
        assert worker.aux_jobs.tick()[0][2] == {"cid": "c1", "result": {"slices": 2}}
        assert worker.models.loads == 0
        refused = worker._handle(AuxiliaryCommand(b"p", "c2", AuxiliaryRequest("embedding", "nope", {})))
        assert refused[0][1] is MsgType.ERROR and refused[0][2]["status"] == 404 and refused[0][2]["cid"] == "c2"
        # /unload frees the auxiliary models too and fails their queued jobs
        worker.aux_jobs.add(b"p", "c3", FakeJob(5, []))
        events, result = mlx_thread.unload(worker, {})
        assert result == {"status": "success", "auxiliary_unloaded": ["bert-a"]}
        assert events[0][2]["cid"] == "c3" and events[0][2]["status"] == 503
        assert worker.aux.catalogue() == []
    finally:
        context.term()


def test_a_full_auxiliary_queue_refuses_with_429(tmp_path: Path, loaded: list[FakeModel]) -> None:
    model_dir(tmp_path, "bert-a", 10)
    context = zmq.Context()
    try:
        worker = MlxWorker(context, "inproc://unused", SchedulerConfig(model_dirs=(tmp_path,), max_queued=1))
        worker.aux_jobs.add(b"p", "waiting", FakeJob(5, []))
        [(_, kind, body)] = worker._handle(AuxiliaryCommand(b"p", "c", AuxiliaryRequest("embedding", "bert-a", {})))
        assert kind is MsgType.ERROR and body["status"] == 429 and body["code"] == "queue_full"
        assert loaded == []  # refused before any load
    finally:
        context.term()
