"""Reads a waiting prompt's prefix from the disk tier on a thread of its own, so the streams go on meanwhile.

Why: reading an entry means hashing the whole file (its content hash is checked on every load)
and reading it: ~0.8 s a GB on this 2-core VM while the hash was SHA-256 (XXH3 since: `content_hash`),
and an agent's 20k-token prefix on an 8B model is 2.6 GB in bf16. Done on the mlx thread at
admission, every running stream waited for it.
Now the scheduler asks `DiskReads.ahead` before admitting a prompt whose best prefix is on
disk: the read starts on this thread and the prompt waits in the queue (others are admitted
meanwhile), then `take` hands the KV to its admission. xxhash and MLX release the GIL while
they hash and read, so the mlx thread keeps stepping. A read nobody takes (its request left)
is dropped `KEEP_SECONDS` after it ended, and at most `KEEP_READS` are held, so unclaimed KV
does not pile up in memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from engine_daemon.prefix_cache.disk import DiskEntry

KEEP_SECONDS = 30.0  # a finished read nobody took in this long is let go
KEEP_READS = 4  # reads held at once (running or finished and not taken yet)


class DiskReads:
    """Reads in flight or done, by entry file name, in the order they started."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = 0  # reads begun ahead of an admission
        self._executor: ThreadPoolExecutor | None = None
        self._reads: OrderedDict[str, Future] = OrderedDict()
        self._ended: dict[str, float] = {}  # when each read ended (its age counts from there, not from its queueing)

    def ahead(self, entry: DiskEntry, read: Callable[[], list[Any] | None]) -> bool:
        """Whether `entry`'s read is still running (started now if it had not been): its prompt waits.

        A finished read is kept for its prompt until `take` (or `KEEP_SECONDS` after it ended): it is
        never let go to make room, which had a fifth prompt's read push out the one a waiting prompt
        was about to take, over and over. With `KEEP_READS` held no read starts: the prompt is read at
        its admission, as before reads went ahead.
        """
        held = self._reads.get(entry.path.name)
        if held is not None:
            return not held.done()
        self._let_go()
        if len(self._reads) >= KEEP_READS:
            return False
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="prompt-cache-reader")
        name = entry.path.name
        future = self._executor.submit(read)
        self._reads[name] = future  # before the callback, which runs here at once if the read already ended
        future.add_done_callback(lambda done: self._ended_now(name, done))
        self.started += 1
        return True

    def _ended_now(self, name: str, future: Future) -> None:
        """Notes when the read ended (the reader's thread), unless it was taken meanwhile: a stale time for its
        name would let `_let_go` drop a later read of the same file early."""
        if self._reads.get(name) is future:
            self._ended[name] = self.clock()

    def holds(self, entry: DiskEntry) -> bool:
        """Whether a read of `entry` was begun ahead (`fetch` then takes it, whatever the speeds say now)."""
        return entry.path.name in self._reads

    def take(self, entry: DiskEntry, read: Callable[[], list[Any] | None]) -> list[Any] | None:
        """`entry`'s KV: from the read begun ahead (waiting for it if it still runs), else read here and now."""
        future = self._reads.pop(entry.path.name, None)
        self._ended.pop(entry.path.name, None)
        self._let_go()
        return future.result() if future is not None else read()

    def wait(self, timeout: float) -> None:
        """Sleeps until a read ends or `timeout` seconds pass (an engine with nothing else to do)."""
        self._let_go()
        running = [future for future in self._reads.values() if not future.done()]
        if running:
            wait(running, timeout=timeout, return_when="FIRST_COMPLETED")

    def close(self) -> None:
        self._reads.clear()
        self._ended.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def __len__(self) -> int:
        return len(self._reads)

    def _let_go(self) -> None:
        """Drops finished reads nobody took within `KEEP_SECONDS` of their end (their request left)."""
        now = self.clock()
        for name, ended in list(self._ended.items()):
            if now - ended > KEEP_SECONDS:
                self._reads.pop(name, None)
                del self._ended[name]
