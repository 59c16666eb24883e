"""Writes evicted prefixes to the disk tier on a thread of its own, so that no stream waits on the disk.

Why: the memory tier evicts on the mlx thread, in the middle of a request's admission or of a
prompt's sharing, and writing an entry there stalled every running stream for as long as the
disk took. An agent's 4,000-token prefix on an 8B-shaped float32 model is ~1 GB: 3.0 s to save
and 1.4 s to hash (SHA-256, since XXH3) on this 2-core VM, during which no stream got a token, so one client's new
prompt could freeze everyone else's. Here the mlx thread only hands the entry over: the arrays
are already evaluated (`DiskTier.store_later` makes sure), MLX releases the GIL while it saves,
and xxhash while it hashes, so the streams go on beside the write.

The queue holds the evicted arrays in memory until they are written, so it is bounded
(`max_pending_bytes`, or a single entry beside the one being written): past it the caller waits
for the writer to catch up, as every write waited before, and an entry is never dropped. A
model switch and a clean shutdown `flush` the queue before they write their own entries. The
write still takes CPU: on the 2-core VM a 0.4 GB entry's ~2.5 s of saving and hashing made the
decode steps beside it 4-9x dearer (BLAS splits each product over both cores), where the mlx
thread's own write had stopped them for 1.3-1.6 s; with more cores than BLAS threads it is free.
Until its file is written a queued entry is still in memory, and lookups find it there
(`pending`, `DiskTier.pending_match`): a request that comes back for an evicted prefix while it
is being written reuses it rather than prefilling it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Evicted bytes the writer may hold before a new eviction waits for it (one larger entry is taken alone).
MAX_PENDING_BYTES = 1 << 30


@dataclass
class Spill:
    key: str
    tokens: np.ndarray
    cache: list[Any]
    trimmable: bool
    nbytes: int


class SpillWriter:
    """A daemon thread that calls `write(key, tokens, cache, trimmable)` for each queued `Spill`, in order."""

    def __init__(self, write: Callable[[str, np.ndarray, list[Any], bool], bool],
                 max_pending_bytes: int = MAX_PENDING_BYTES):
        self.write = write
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.queued = self.waited = 0  # spills handed over; those whose caller had to wait for room
        self._queue: deque[Spill] = deque()
        self._current: Spill | None = None  # the spill taken off the queue and being written
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, spill: Spill) -> None:
        """Queues `spill`; waits only while the queue holds more than `max_pending_bytes` (never for an empty one)."""
        with self._changed:
            if self._queue and self.pending_bytes + spill.nbytes > self.max_pending_bytes:
                self.waited += 1
                self._changed.wait_for(lambda: not self._queue or
                                       self.pending_bytes + spill.nbytes <= self.max_pending_bytes)
            self._queue.append(spill)
            self.pending_bytes += spill.nbytes
            self.queued += 1
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="prompt-cache-writer", daemon=True)
                thread.start()
                self._thread = thread  # only once started: a failed start is retried by the next spill
            self._changed.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued spill is written; False if `timeout` seconds passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and self._current is None, timeout)

    def pending(self) -> list[Spill]:
        """The spills not written yet, the one being written included (their arrays are only read meanwhile)."""
        with self._changed:
            return ([self._current] if self._current is not None else []) + list(self._queue)

    def __len__(self) -> int:
        return len(self.pending())

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue))
                spill = self._current = self._queue.popleft()
                self._changed.notify_all()  # a caller waiting for room may go on
            try:
                self.write(spill.key, spill.tokens, spill.cache, spill.trimmable)
            except Exception:  # the cache is an optimisation: one failed write must not stop the next ones
                log.exception("prompt cache: writing an entry of %d tokens failed", len(spill.tokens))
            finally:
                with self._changed:
                    self._current = None
                    self.pending_bytes -= spill.nbytes
                    self._changed.notify_all()
