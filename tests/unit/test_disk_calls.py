"""`list_models` reads the disk off the io thread, and one scan answers every caller for a few seconds.

Review item: the catalogue (a scan of --model-dir and the Hugging Face cache) ran on the io thread, through
which every stream's frames go: a slow disk or a huge cache stood them all still, and every front-end
worker asks every engine for it at its start and every 10 minutes. Each of N workers asking at once
scanned again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import pytest
import zmq

from engine_daemon.config import SchedulerConfig
from engine_daemon.transport.server import EngineServer
from protocol import PROTOCOL_VERSION, MsgType, decode, encode


def test_pings_are_answered_while_a_slow_catalogue_scan_runs(ipc_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan is held until a PING has been answered during it: no duration is asserted, only that the io
    thread answered while the disk was busy (on the old code the PONG comes only once the scan is let go)."""
    scans: list[float] = []
    scanning, release = threading.Event(), threading.Event()

    def slow_scan(*args: Any, **kwargs: Any) -> Any:
        scans.append(time.monotonic())
        scanning.set()
        release.wait(60)  # a slow disk, or a cache of many thousand repositories
        raise OSError("no cache here")  # `list_cached_models`: no models from the cache

    monkeypatch.setattr(huggingface_hub, "scan_cache_dir", slow_scan)
    server = EngineServer(f"ipc://{ipc_dir}/disk-calls.sock", SchedulerConfig(model_dirs=(tmp_path,)))
    serving = threading.Thread(target=server.serve, name="test-engine")
    serving.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION, "frontend_id": "test"}))
        assert sock.poll(30_000) and decode(sock.recv())[0] == MsgType.WELCOME
        for i in range(4):  # four front-end workers starting at once
            sock.send(encode(MsgType.CALL, {"cid": f"models-{i}", "method": "list_models", "args": {}}))
        assert scanning.wait(30), "no scan started"
        sock.send(encode(MsgType.PING, {"t": 1.0}))
        answered_during_scan = sock.poll(20_000) and decode(sock.recv())[0] == MsgType.PONG
        release.set()
        assert answered_during_scan, "the PING was not answered while the catalogue scan ran"
        results = {}
        while len(results) < 4:
            assert sock.poll(30_000), f"only {sorted(results)} answered"
            kind, body = decode(sock.recv())
            if kind == MsgType.RESULT:
                results[body["cid"]] = body["result"]
        assert all(result == results["models-0"] for result in results.values())
        assert len(scans) == 1, f"{len(scans)} scans for four callers at once"
    finally:
        release.set()
        sock.close()
        server.stop()
        serving.join(30)
    assert not serving.is_alive()


class Ctx:
    """What `list_models` reads of the engine server (weakly referenced: the cache's key)."""

    def __init__(self) -> None:
        names = SimpleNamespace(catalogue=lambda: [], entries={}, name_of_path=lambda path: None)
        self.worker = SimpleNamespace(
            models=SimpleNamespace(names=names, current=None),
            scheduler=SimpleNamespace(config=SimpleNamespace(model_dirs=())),
            aux=SimpleNamespace(snapshot=[], catalogue=lambda: [], loaded_dirs=lambda: []))


def test_a_scan_is_reused_while_the_loaded_models_stay_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_daemon.calls import catalogue

    scans: list[int] = []
    monkeypatch.setattr(catalogue, "list_cached_models",
                        lambda: scans.append(1) or [{"id": "org/m", "created": 1, "path": "", "kind": "text"}])
    ctx = Ctx()
    assert catalogue.list_models(ctx, {}) == [{"id": "org/m", "created": 1, "kind": "text", "loaded": False}]
    catalogue.list_models(ctx, {"anything": "a client sends"})
    assert len(scans) == 1
    ctx.worker.aux.snapshot = []  # an auxiliary model loaded or unloaded: a new snapshot
    catalogue.list_models(ctx, {})
    assert len(scans) == 2
    ctx.worker.models.current = SimpleNamespace(ref=SimpleNamespace(id="other", path="/nowhere"), loaded_at=2.0,
                                                kind="text", context_window=8)
    assert catalogue.list_models(ctx, {})[0]["id"] == "other"
    assert len(scans) == 3
    catalogue.list_models(Ctx(), {})  # another engine server in the process: its own scan
    assert len(scans) == 4
    monkeypatch.setattr(catalogue, "CATALOGUE_TTL", 0.0)
    catalogue.list_models(ctx, {})
    assert len(scans) == 5
