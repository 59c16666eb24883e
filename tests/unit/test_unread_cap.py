"""A front-end that pings but never reads has its requests aborted past --peer-max-queued (red team E8).

The engine queued its DELTAS up to SEND_HWM frames (70 MB after 60 s, GBs possible). Its PINGs now say
how much it read (`rx`); what it left unread is bounded.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine_daemon.config import SchedulerConfig
from engine_daemon.scheduling.commands import PeerGoneCommand
from engine_daemon.transport.server import EngineServer
from protocol import MsgType

FRAME = b"\x13" + b"d" * 99_999  # 100 kB of DELTAS


class Router:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes]] = []

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        self.sent.append((parts[0], parts[1]))


@pytest.fixture
def server(tmp_path: Path):
    server = EngineServer("ipc://unused", SchedulerConfig(model_dirs=(tmp_path,)), peer_max_queued=1_000_000)
    yield server
    server.preprocessor.close()
    server.context.term()


def gone(server: EngineServer) -> list[bytes]:
    out = []
    while not server.worker.commands.empty():
        command = server.worker.commands.get_nowait()
        if isinstance(command, PeerGoneCommand):
            out.append(command.peer)
    return out


def test_a_peer_that_reads_nothing_is_cut_off(server: EngineServer, caplog: pytest.LogCaptureFixture) -> None:
    router = Router()
    server._on_hello(router, b"sink", {"version": 1, "frontend_id": "sink"})  # type: ignore[arg-type]
    sends = 0
    with caplog.at_level(logging.WARNING):
        while not gone(server) and sends < 100:  # bounded: the cap is 1 MB
            server._on_ping(router, b"sink", {"t": 0, "rx": 0})  # type: ignore[arg-type]  # alive, reads nothing
            server._send(router, b"sink", FRAME)  # type: ignore[arg-type]
            sends += 1
    assert sends == 10  # the first frame past 1 MB unread (with its WELCOME and PONGs)
    assert "left 1 MiB of output unread" in caplog.text
    assert b"sink" in server.dropped  # its next frame hears frontend_dropped


def test_a_peer_that_never_says_rx_is_an_older_front_end_and_keeps_streaming(server: EngineServer) -> None:
    """Front-ends of an earlier release send PINGs without `rx`: counted as reading nothing, they were cut after
    64 MB of output in all, though they read everything (upgrade order: engine first, front-ends later)."""
    router = Router()
    for _ in range(40):
        server._on_ping(router, b"old", {"t": 0})  # type: ignore[arg-type]
        server._reply(router, b"old", MsgType.DELTAS, {"items": [{"rid": "x", "text": "d" * 99_990}]})  # type: ignore[arg-type]
    assert not gone(server)


def test_a_peer_that_reads_keeps_streaming(server: EngineServer) -> None:
    router = Router()
    server._on_hello(router, b"reader", {"version": 1, "frontend_id": "reader"})  # type: ignore[arg-type]
    read = 0
    server._on_ping(router, b"reader", {"t": 0, "rx": read})  # type: ignore[arg-type]
    for _ in range(200):  # 20 MB in all, never more than 0.5 MB unread
        for _ in range(5):
            server._send(router, b"reader", FRAME)  # type: ignore[arg-type]
        read += 5 * len(FRAME)
        server._on_ping(router, b"reader", {"t": 0, "rx": read})  # type: ignore[arg-type]
    assert gone(server) == [] and b"reader" in server.peers


def test_a_cut_off_peer_that_still_reads_nothing_is_cut_again_at_once(server: EngineServer) -> None:
    router = Router()
    server._on_hello(router, b"sink", {"version": 1, "frontend_id": "sink"})  # type: ignore[arg-type]
    server._on_ping(router, b"sink", {"t": 0, "rx": 0})  # type: ignore[arg-type]  # says what it reads: nothing
    for _ in range(100):  # bounded: the cap is 1 MB, 10 frames
        if gone(server):
            break
        server._send(router, b"sink", FRAME)  # type: ignore[arg-type]
    else:
        pytest.fail("never cut off")
    server._on_ping(router, b"sink", {"t": 0, "rx": 0})  # type: ignore[arg-type]  # back, still reading nothing
    server._send(router, b"sink", FRAME)  # type: ignore[arg-type]  # its next request's first output
    assert gone(server) == [b"sink"]
    server._on_ping(router, b"sink", {"t": 0, "rx": 5_000_000})  # type: ignore[arg-type]  # it read its backlog
    server._send(router, b"sink", FRAME)  # type: ignore[arg-type]
    assert gone(server) == []
