"""Evicted prefixes are written by the disk tier's own thread: an eviction never waits on the disk.

Real mlx KV caches and a real `DiskTier` in a temporary directory; the writer's `write` is gated
by events where a test needs a write to be in progress.
"""

from __future__ import annotations

import errno
import shutil
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine_daemon.prefix_cache.disk import DiskTier, _entry_digest, content_hash, key_digest
from engine_daemon.prefix_cache.spill_writer import Spill, SpillWriter
from engine_daemon.prefix_cache.tiered import PrefixCache
from tests.unit.test_prefix_cache import kv, same

KEY = ("model-identity", None)


def gated(tier: DiskTier) -> tuple[threading.Event, threading.Event]:
    """(started, release): the tier's writer signals `started` when a write begins and waits for `release`."""
    started, release, write = threading.Event(), threading.Event(), tier.writer.write

    def slow_write(*args):
        started.set()
        assert release.wait(60)
        return write(*args)

    tier.writer.write = slow_write
    return started, release


def stored_with_gated_reads(tmp_path: Path) -> tuple[PrefixCache, list, threading.Event, list[str]]:
    """(prefix cache, the KV of tokens 0-299 stored on its disk tier, release, reads): each disk read records its
    thread's name in `reads` and waits for `release`."""
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    original = kv(300)
    assert disk.store(key_digest(*KEY), np.arange(300, dtype=np.int32), original, trimmable=True)
    cache = PrefixCache(max_entries=4, max_bytes=1 << 40, disk=disk)
    release, reads, load = threading.Event(), [], disk.load

    def slow_load(entry, layout=None):
        reads.append(threading.current_thread().name)
        assert release.wait(60)
        return load(entry, layout)

    disk.load = slow_load
    return cache, original, release, reads


def test_an_eviction_returns_while_its_file_is_written_and_the_prefix_is_served_meanwhile(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    started, release = gated(disk)
    cache = PrefixCache(max_entries=1, max_bytes=1 << 40, disk=disk)
    original = kv(300)
    mx.eval([c.state for c in original])
    cache.insert(KEY, list(range(300)), original)
    cache.insert(KEY, list(range(5000, 5300)), kv(300, seed=3))  # evicts the first: handed to the writer
    assert started.wait(60)
    assert len(disk.writer) == 1 and not list(tmp_path.glob("*.safetensors"))  # the write has not finished

    found, length = cache.fetch(KEY, list(range(400)))  # the prefix comes back while it is being written
    assert length == 300 and same(found, original, 300) and cache.hits == {"memory": 1, "disk": 0, "in_flight": 0}
    found[0].trim(100)  # a private copy: the entry being written is untouched
    release.set()
    assert disk.flush(timeout=60) and len(disk.writer) == 0
    assert disk.writes == 1 and disk.stats()["prompt_cache_disk_spills_queued"] == 1

    fresh = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)  # another process, later
    entry, shared = fresh.best_match(key_digest(*KEY), np.arange(400, dtype=np.int32), at_least=0)
    assert shared == 300 and same(fresh.load(entry), original, 300)


def test_a_full_queue_makes_the_next_eviction_wait_and_loses_nothing(tmp_path: Path) -> None:
    written: list[int] = []
    started, release = threading.Event(), threading.Event()

    def write(key, tokens, cache, trimmable) -> bool:
        started.set()
        assert release.wait(60)
        written.append(int(tokens[0]))
        return True

    writer = SpillWriter(write, max_pending_bytes=250)
    writer.submit(Spill("k", np.array([1]), [], True, 200))
    assert started.wait(60)  # the writer took it: the queue is empty
    writer.submit(Spill("k", np.array([2]), [], True, 600))  # past the bound, but an empty queue takes it
    assert writer.waited == 0 and writer.pending_bytes == 800
    submitted = threading.Event()
    waiter = threading.Thread(target=lambda: (writer.submit(Spill("k", np.array([3]), [], True, 100)),
                                              submitted.set()))
    waiter.start()
    deadline = time.monotonic() + 60
    while writer.waited == 0 and time.monotonic() < deadline:  # 600 bytes queued past the bound: the third waits
        time.sleep(0.01)
    assert writer.waited == 1
    assert not submitted.is_set()
    release.set()
    assert submitted.wait(60) and writer.flush(timeout=60)
    waiter.join()
    assert written == [1, 2, 3] and writer.pending_bytes == 0 and writer.waited == 1


def test_a_failed_write_does_not_stop_the_writer(tmp_path: Path) -> None:
    written: list[int] = []

    def write(key, tokens, cache, trimmable) -> bool:
        if tokens[0] == 1:
            raise OSError("disk full")
        written.append(int(tokens[0]))
        return True

    writer = SpillWriter(write)
    for first in (1, 2):
        writer.submit(Spill("k", np.array([first]), [], True, 10))
    assert writer.flush(timeout=60) and written == [2]


def test_spill_all_writes_what_is_queued_and_what_memory_holds(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    started, release = gated(disk)
    cache = PrefixCache(max_entries=1, max_bytes=1 << 40, disk=disk)
    cache.insert(KEY, list(range(300)), kv(300))
    cache.insert(KEY, list(range(5000, 5300)), kv(300, seed=3))
    assert started.wait(60)
    threading.Timer(0.2, release.set).start()
    assert cache.spill_all() == 1 and len(disk.writer) == 0  # waited for the queued one, then wrote its own
    assert len(list(tmp_path.glob("*.safetensors"))) == 2 and disk.writes == 2


def test_a_file_copied_under_another_entry_name_is_not_served(tmp_path: Path) -> None:
    """Red team: the name's entry digest was not checked, so a valid file copied (or renamed, its content hash
    recomputed) under another prefix's name was served for that prefix."""
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    assert disk.store("k", np.arange(300, dtype=np.int32), kv(300), trimmable=True)
    (source,) = tmp_path.glob("*.safetensors")
    other = np.arange(1000, 1300, dtype=np.int32)
    copied = tmp_path / f"{_entry_digest('k', other)}-{content_hash(source)}.safetensors"
    shutil.copy(source, copied)
    reader = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    assert len(reader) == 1 and reader.best_match("k", other, at_least=0) is None
    assert reader.best_match("k", np.arange(400, dtype=np.int32), at_least=0)[1] == 300


def test_a_prefix_on_disk_is_read_ahead_while_its_prompt_waits(tmp_path: Path) -> None:
    """`PrefixCache.reading` starts the read on the reader's thread and says wait while it runs; `fetch` then takes
    that read (no second read on the mlx thread) and gets the same KV as a read there would."""
    cache, original, release, reads = stored_with_gated_reads(tmp_path)
    prompt = list(range(400))
    assert cache.reading(KEY, prompt) and cache.reading(KEY, prompt)  # started once, still running
    assert not cache.reading(KEY, list(range(1000, 1400)))  # nothing on disk for this one: no wait
    release.set()
    cache.reads.wait(60)
    assert not cache.reading(KEY, prompt)  # read: it may be admitted
    found, length = cache.fetch(KEY, prompt)
    assert length == 300 and same(found, original, 300) and cache.hits["disk"] == 1
    assert reads == ["prompt-cache-reader_0"] and cache.stats()["prompt_cache_disk_reads_ahead"] == 1
    assert len(cache.reads) == 0  # taken


def test_reads_nobody_takes_are_let_go(tmp_path: Path) -> None:
    from engine_daemon.prefix_cache.disk_reads import KEEP_SECONDS, DiskReads

    now = [0.0]
    reads = DiskReads(clock=lambda: now[0])
    entries = [type("Entry", (), {"path": tmp_path / f"{i}.safetensors"})() for i in range(6)]
    assert reads.ahead(entries[0], lambda: [1])
    reads.wait(60)
    now[0] = KEEP_SECONDS + 1
    assert reads.ahead(entries[1], lambda: [2]) and len(reads) == 1  # the first was let go, unclaimed
    assert reads.take(entries[0], lambda: ["read now"]) == ["read now"]
    reads.close()


def test_a_vision_prefix_evicted_and_not_yet_written_is_served_from_memory(tmp_path: Path) -> None:
    """The vision tier's lookup (`TieredAPCManager.lookup_prefix_disk_cache`, what mlx-vlm asks when memory does
    not cover a prompt) finds an entry handed to the writer and not written yet, as the text tier's does."""
    from engine_daemon.prefix_cache.vision_apc import TieredAPCManager, entry_key

    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    started, release = gated(disk)
    manager = TieredAPCManager(1 << 30, disk, "vision-model", set())
    original = kv(300)
    mx.eval([c.state for c in original])
    assert disk.store_later(entry_key("vision-model", None, 0), np.arange(300, dtype=np.int32), original, True)
    assert started.wait(60) and not list(tmp_path.glob("*.safetensors"))
    warm, shared = manager.lookup_prefix_disk_cache(list(range(400)))
    assert shared == 300 and mx.array_equal(warm[0].keys[..., :300, :], original[0].keys[..., :300, :]).item()
    release.set()
    assert disk.flush(timeout=60)
    assert mx.array_equal(original[0].keys, kv(300)[0].keys).item()  # the written entry was never changed
    again, shared_again = manager.lookup_prefix_disk_cache(list(range(400)))  # now from the file
    assert shared_again == 300 and disk.hits == 1
    assert mx.array_equal(again[1].values[..., :300, :], original[1].values[..., :300, :]).item()


def test_finished_reads_wait_for_their_prompts_and_a_full_table_reads_at_admission(tmp_path: Path) -> None:
    """Review: with `KEEP_READS` held, a fifth prompt's read pushed out the finished read a waiting prompt was about
    to take, over and over (four prompts never admitted); and a read's age counted its time queued, so a read
    slower than `KEEP_SECONDS` was dropped and started again forever."""
    from engine_daemon.prefix_cache.disk_reads import KEEP_READS, KEEP_SECONDS, DiskReads

    now = [0.0]
    reads = DiskReads(clock=lambda: now[0])
    entries = [type("Entry", (), {"path": tmp_path / f"{i}.safetensors"})() for i in range(KEEP_READS + 1)]
    for i, entry in enumerate(entries[:KEEP_READS]):
        assert reads.ahead(entry, lambda i=i: [i])
    while any(reads.ahead(entry, lambda: None) for entry in entries[:KEEP_READS]):
        reads.wait(60)
    now[0] = 0.5 * KEEP_SECONDS
    assert not reads.ahead(entries[-1], lambda: ["never"])  # a full table: read at its admission instead
    assert reads.take(entries[-1], lambda: ["read now"]) == ["read now"]
    assert not any(reads.ahead(entry, lambda: None) for entry in entries[:KEEP_READS])  # still held, finished
    assert [reads.take(entry, lambda: None) for entry in entries[:KEEP_READS]] == [[i] for i in range(KEEP_READS)]

    release = threading.Event()
    assert reads.ahead(entries[0], lambda: [release.wait(60) and "slow"])  # queued at 0.5 KEEP_SECONDS
    now[0] = 2 * KEEP_SECONDS
    release.set()
    while reads.ahead(entries[0], lambda: None):
        reads.wait(60)
    now[0] = 2.5 * KEEP_SECONDS  # 2 KEEP_SECONDS after it was queued, half of one after it ended: kept
    reads.wait(0)
    assert reads.take(entries[0], lambda: ["read again"]) == ["slow"]
    reads.close()


def test_a_scoring_lookup_neither_reads_the_disk_nor_waits_for_a_read(tmp_path: Path) -> None:
    """Review: a prompt-scoring job's lookup (`fetch(..., wait=False)`, started on the mlx thread between steps) took
    over another prompt's running read and waited for it, and with none begun read the file there: every stream
    waited for the disk. It now looks in memory only, and leaves a finished read to the prompt that waits for it."""
    cache, original, release, reads = stored_with_gated_reads(tmp_path)
    prompt = list(range(400))
    assert cache.fetch(KEY, prompt, wait=False) == (None, 0) and reads == []  # nothing read on this thread
    assert cache.reading(KEY, prompt)  # another request's read ahead, still running
    assert cache.fetch(KEY, prompt, wait=False) == (None, 0) and len(cache.reads) == 1  # not taken over
    release.set()
    cache.reads.wait(60)
    assert cache.fetch(KEY, prompt, wait=False) == (None, 0)  # finished, and still the waiting prompt's
    found, length = cache.fetch(KEY, prompt)  # that prompt's admission takes it: one read in all
    assert length == 300 and same(found, original, 300) and reads == ["prompt-cache-reader_0"]
    assert cache.reads.started == 1


@pytest.mark.parametrize("failure", [MemoryError("std::bad_alloc"),
                                     RuntimeError("[metal::malloc] Unable to allocate 2147483648 bytes."),
                                     OSError(errno.EMFILE, "Too many open files")])
def test_a_read_the_machine_fails_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 failure: Exception) -> None:
    """Review: an allocation failure while a valid file was read counted it as damaged and deleted it; the
    prefix was gone for the next request, which would have had the memory to load it."""
    from engine_daemon.prefix_cache import disk as disk_module

    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    original = kv(300)
    assert disk.store(key_digest(*KEY), np.arange(300, dtype=np.int32), original, trimmable=True)
    entry, _shared = disk.best_match(key_digest(*KEY), np.arange(400, dtype=np.int32), at_least=0)
    real = disk_module.load_prompt_cache

    def failing(*args, **kwargs):
        raise failure

    monkeypatch.setattr(disk_module, "load_prompt_cache", failing)
    assert disk.load(entry) is None
    assert entry.path.exists() and len(disk) == 1
    assert disk.stats()["prompt_cache_disk_read_failures"] == 1 and disk.corrupt == 0
    # Not offered again at once: a failure that repeats would cost a full hash and read for every matching prompt.
    assert disk.best_match(key_digest(*KEY), np.arange(400, dtype=np.int32), at_least=0) is None
    monkeypatch.setattr(disk_module, "load_prompt_cache", real)
    monkeypatch.setattr(disk_module, "RETRY_AFTER_SECONDS", 0.0)  # later
    entry, _shared = disk.best_match(key_digest(*KEY), np.arange(400, dtype=np.int32), at_least=0)
    assert same(disk.load(entry), original, 300) and disk.hits == 1  # the next read, with memory free
