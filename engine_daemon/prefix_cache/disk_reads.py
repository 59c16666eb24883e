"""Reads a waiting prompt's prefix from the disk tier on a thread of its own, so the streams go on meanwhile.

Why: reading an entry means hashing the whole file (its content hash is checked on every load)
and reading it: ~0.8 s a GB on this 2-core VM, and an agent's 20k-token prefix on an 8B model
is 2.6 GB in bf16. Done on the mlx thread at admission, every running stream waited for it.
Now the scheduler asks `DiskReads.ahead` before admitting a prompt whose best prefix is on
disk: the read starts on this thread and the prompt waits in the queue (others are admitted
meanwhile), then `take` hands the KV to its admission. hashlib and MLX release the GIL while
they hash and read, so the mlx thread keeps stepping. A read nobody takes (its request left)
is dropped after `KEEP_SECONDS`, and at most `KEEP_READS` are held, so unclaimed KV does not
pile up in memory.
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
        self._reads: OrderedDict[str, tuple[Future, float]] = OrderedDict()

    def ahead(self, entry: DiskEntry, read: Callable[[], list[Any] | None]) -> bool:
        """Whether `entry`'s read is still running (started now if it had not been): its prompt waits."""
        self._let_go()
        held = self._reads.get(entry.path.name)
        if held is None:
            if len(self._reads) >= KEEP_READS:
                return False  # enough KV read ahead and not taken yet: this one is read at its admission
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="prompt-cache-reader")
            self._reads[entry.path.name] = (self._executor.submit(read), self.clock())
            self.started += 1
            return True
        return not held[0].done()

    def take(self, entry: DiskEntry, read: Callable[[], list[Any] | None]) -> list[Any] | None:
        """`entry`'s KV: from the read begun ahead (waiting for it if it still runs), else read here and now."""
        held = self._reads.pop(entry.path.name, None)
        return held[0].result() if held is not None else read()

    def wait(self, timeout: float) -> None:
        """Sleeps until a read ends or `timeout` seconds pass (an engine with nothing else to do)."""
        running = [future for future, _ in self._reads.values() if not future.done()]
        if running:
            wait(running, timeout=timeout, return_when="FIRST_COMPLETED")

    def close(self) -> None:
        self._reads.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def __len__(self) -> int:
        return len(self._reads)

    def _let_go(self) -> None:
        now = self.clock()
        for name, (future, began) in list(self._reads.items()):
            if future.done() and now - began > KEEP_SECONDS:
                del self._reads[name]
        while len(self._reads) >= KEEP_READS:
            done = [name for name, (future, _) in self._reads.items() if future.done()]
            if not done:
                break
            del self._reads[done[0]]
