"""The front-end's connection guards that need no socket: the log-flood filter and the open-file limit
(`RepeatFilter`, `raise_open_file_limit`). The guards on real connections: tests/stack/test_connections.py."""

from __future__ import annotations

import logging
import resource

from http_frontend.gunicorn_settings import DEFAULT_WORKER_CLASS
from http_frontend.middleware.connections import GuardedASGIWorker, RepeatFilter, raise_open_file_limit


def record(message: str, *args: object, level: int = logging.ERROR, name: str = "asyncio") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, args, None)


def test_a_flood_of_one_message_is_let_through_once_per_interval() -> None:
    flood = RepeatFilter(interval=60.0)
    passed = [flood.filter(record("socket.accept() out of system resource")) for _ in range(100_000)]
    assert sum(passed) == 1


def test_the_next_line_after_the_interval_says_how_many_were_held_back() -> None:
    flood = RepeatFilter(interval=0.0)
    first = record("Error handling connection: %s", "x")
    assert flood.filter(first) and "held" not in first.getMessage()
    flood.interval = 3600.0
    for _ in range(5):
        assert not flood.filter(record("Error handling connection: %s", "y"))
    flood.interval = 0.0
    later = record("Error handling connection: %s", "z")
    assert flood.filter(later) and "(5 more like this" in later.getMessage() and later.getMessage().startswith(
        "Error handling connection: z")


def test_different_messages_and_levels_are_counted_apart() -> None:
    flood = RepeatFilter(interval=60.0)
    assert flood.filter(record("one")) and flood.filter(record("two"))
    assert flood.filter(record("one", level=logging.WARNING)) and flood.filter(record("one", name="gunicorn.error"))


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        now = raise_open_file_limit(logging.getLogger("test"))
        assert now == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= soft
        if hard != resource.RLIM_INFINITY:
            assert now == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_guarded_worker_is_the_default_worker_class() -> None:
    module, _, name = DEFAULT_WORKER_CLASS.rpartition(".")
    assert (module, name) == (GuardedASGIWorker.__module__, GuardedASGIWorker.__name__)
