"""Log lines a peer can cause are rate-limited and clipped (red team E9: 87 MB of log in 20 s)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine_daemon.config import SchedulerConfig
from engine_daemon.errors import clipped
from engine_daemon.scheduling.commands import AbortCommand
from engine_daemon.scheduling.inbox import PendingAborts
from engine_daemon.transport.handshake_log import QuietLog
from engine_daemon.transport.server import EngineServer


def test_quiet_log_folds_repeats_per_key_and_bounds_its_keys() -> None:
    quiet = QuietLog(quiet=60, max_keys=3)
    assert quiet.allow("a") == 0
    assert [quiet.allow("a") for _ in range(5)] == [None] * 5
    assert quiet.allow("b") == 0  # another peer is heard
    for key in "cdef":
        quiet.allow(key)
    assert len(quiet._last) == 3


def test_a_peers_garbage_frames_make_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = EngineServer("ipc://unused", SchedulerConfig(model_dirs=(tmp_path,)))
    try:
        with caplog.at_level(logging.WARNING, logger="engine_daemon.transport.server"):
            for _ in range(10_000):
                server._receive(None, [b"evil", b"\x03\xc1" * 10])  # type: ignore[arg-type]
                server._receive(None, [b"evil", b"x", b"y"])  # type: ignore[arg-type]
            server._receive(None, [b"other", b"\x03\xc1"])  # type: ignore[arg-type]
        lines = [record.getMessage() for record in caplog.records]
        assert sum("bad frame from b'evil'" in line for line in lines) == 1, lines[:5]
        assert sum("frames from b'evil'" in line for line in lines) == 1, lines[:5]
        assert sum("bad frame from b'other'" in line for line in lines) == 1
    finally:
        server.preprocessor.close()
        server.context.term()


def test_client_strings_in_log_lines_are_clipped(caplog: pytest.LogCaptureFixture) -> None:
    assert clipped("short") == "short"
    long = clipped("r" * 1_000_000)
    assert len(long) < 100 and "1000000" in long

    class Finds:
        def owned_by(self, peer: bytes, rids: set[str]) -> tuple[set[str], set[str]]:
            return rids, set()

        def abort(self, rids: set[str]) -> int:
            return len(rids)

    class NoJobs:
        def has_work(self) -> bool:
            return False

    with caplog.at_level(logging.INFO, logger="engine_daemon.scheduling.inbox"):
        PendingAborts(AbortCommand(["r" * 1_000_000, *map(str, range(100))], "x" * 10_000)).apply(Finds(), NoJobs())
    [line] = [record.getMessage() for record in caplog.records]
    assert len(line) < 2000 and "and 93 more" in line
