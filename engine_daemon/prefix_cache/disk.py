"""The disk tier: prefixes' KV in safetensors files that outlive a model switch and a restart.

Why: an agent's 20k-token system prompt and tools take minutes to prefill on a laptop for a
large model; a model switch or an engine restart used to forget it. Entries leave memory for
disk when the memory tier evicts them, and all of them on a model switch or a clean
shutdown; a later request loads the longest stored prefix when reading it is faster than
prefilling it (measured read speed against measured prefill speed).

A file is `<entry digest>-<content hash>.safetensors`: the entry digest covers the model
identity (`engine_daemon.models.identity`), the adapter and the tokens; the content
hash (`content_hash`) is checked on every load, and so is its KV against the loading model's own layout
(`kv_layout`): a corrupt, truncated or foreign file is skipped (and deleted) with a log line,
never served. Writes go to a temporary name and are renamed into place, so two engines
sharing a directory see whole files or none; each keeps the directory under the
byte cap by deleting the least recently used files (a load refreshes a file's mtime), making room
before every write and when it opens the directory. Only plain files are read (a FIFO would block
the reader forever), files that are not ours are judged once, and temporary files older than an
hour (a write that died) are deleted. Vision models' entries (`vision_apc`) share the
directory, the format and the cap. Entries the memory tier evicts are written by a thread of
their own (`store_later`, `SpillWriter`): a 1 GB entry took 4.5 s to write, which every running
stream waited for when the mlx thread wrote it. The index is therefore guarded by a lock.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from engine_daemon.prefix_cache.kv_layout import Layout, mismatch
from engine_daemon.prefix_cache.memory import longest_prefix
from engine_daemon.prefix_cache.spill_writer import Spill, SpillWriter

log = logging.getLogger(__name__)

# 2: the content hash is XXH3-128, not SHA-256 (`content_hash`). A file of an earlier format is deleted when found.
FORMAT = "mlx-engined-prefix-2"
FORMAT_FAMILY = "mlx-engined-prefix-"
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 64 << 20  # a header past this is not one of ours
STALE_TEMPORARY_SECONDS = 3600  # a temporary file this old belongs to a write that died
# A file the machine failed to read (`_out_of_resources`) is not offered again for this long: a failure that repeats
# (a buffer past Metal's largest, a bad sector) would otherwise cost a full hash and read for every prompt it matches.
RETRY_AFTER_SECONDS = 60.0


@dataclass
class DiskEntry:
    path: Path
    key: str  # digest of (model identity, adapter)
    tokens: np.ndarray
    trimmable: bool
    nbytes: int


def key_digest(model_identity: str, adapter: str | None) -> str:
    return hashlib.sha256(json.dumps([model_identity, adapter]).encode()).hexdigest()


def _entry_digest(key: str, tokens: np.ndarray) -> str:
    return hashlib.sha256(key.encode() + tokens.astype("<i4").tobytes()).hexdigest()[:32]


def content_hash(path: Path) -> str:
    """The file's XXH3-128, as 32 hex digits: the second half of its name, checked on every load.

    Why XXH3 and not SHA-256: the hash is there to catch damage (a torn or truncated write, a flipped
    bit, a file cut by a full disk), not an adversary; whoever can write the directory can name a file
    after any hash. Every load and every write hashes the whole file, and SHA-256 ran at 1.6 GB/s on
    this project's CI machine against XXH3's 14.4: 0.6 s against 0.07 s for each GB of KV, a cost the
    newcomer's first token paid on a load and that the writer's thread took from the streams' cores.
    """
    digest = xxhash.xxh3_128()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_regular(path: Path) -> bool:
    """A plain file, not followed through a link: a FIFO or device named `*.safetensors` would block a read
    forever (the engine never became ready beside one), a symlink could lead anywhere."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_metadata(path: Path) -> dict[str, str]:
    """The safetensors header's `__metadata__`, read without touching the tensors."""
    if not _is_regular(path):
        raise ValueError("not a regular file")
    with path.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"header of {size} bytes")
        header = json.loads(handle.read(size))
    return header.get("__metadata__") or {}


def _check_lengths(cache: list[Any], tokens: int) -> None:
    """Raises unless every layer that counts its tokens holds the KV of exactly the entry's tokens.

    Why: a file whose KV is shorter than its token list (written so by hand, or by a buggy writer) was
    served as a full hit, and the answer was computed over missing positions.
    """
    for layer, layer_cache in enumerate(cache):
        offset = getattr(layer_cache, "offset", None)
        if isinstance(offset, int) and offset != tokens:
            raise ValueError(f"layer {layer} holds the KV of {offset} tokens, the entry names {tokens}")


# errnos that say the machine could not read a file now, not that the file is bad.
TRANSIENT_ERRNOS = frozenset({errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EIO, errno.EACCES, errno.EPERM})
# Words of the allocation failures MLX raises (`[metal::malloc] Unable to allocate ...`, CUDA's, the CPU's
# `std::bad_alloc` as `MemoryError`).
ALLOCATION_WORDS = ("malloc", "allocate", "out of memory")


def _out_of_resources(exc: BaseException) -> bool:
    """Whether a failed load is the machine's (memory, descriptors, I/O, permissions) rather than the file's.

    Why: every failed load deleted its file as damaged, so a read that met a full memory (a large
    entry beside a loaded model) destroyed a valid prefix that the next request, with memory free,
    would have loaded in a second instead of prefilling for minutes.
    """
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc).lower() for word in ALLOCATION_WORDS)


def _arrays(cache: list[Any]) -> list[mx.array]:
    """The arrays of a KV cache's layers (their `state`), to evaluate."""
    return [array for _, array in tree_flatten([layer.state for layer in cache]) if isinstance(array, mx.array)]


def _cache_nbytes(cache: list[Any]) -> int:
    """Bytes of the arrays an entry would write (its file is this plus a small header)."""
    total = 0
    for layer in cache:
        for array in tree_flatten(getattr(layer, "state", None) or []):
            total += int(getattr(array[1], "nbytes", 0) or 0)
    return total


class DiskTier:
    def __init__(self, directory: str | Path, max_bytes: int, min_tokens: int = 256):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.read_bytes_per_second = 500e6  # a cautious first guess, then measured on every load
        self.hits = self.writes = self.corrupt = self.skipped_slower = 0
        self.read_failures = 0  # loads the machine failed (`_out_of_resources`): files kept
        self.tokens_loaded = 0
        self._index: dict[str, DiskEntry] = {}
        self._skipped: set[str] = set()  # files judged not ours: not read (nor logged) again while they stay
        self._listing_mtime = -1
        self._doomed: list[Path] = []  # files out of the index, to unlink outside the lock
        self._failed: dict[str, float] = {}  # file name -> when the machine last failed to read it (monotonic)
        self._lock = threading.RLock()  # the index: the mlx thread reads it, `writer` adds to it, `/stats` counts it
        self.writer = SpillWriter(self.store)
        self._enforce_cap()  # a cap lowered since the files were written holds from the start, not the next write

    # -- the index ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-reads the directory when it changed (another engine may share it); only new files' headers."""
        with self._lock:
            self._refresh()
        self._unlink_doomed()

    def _refresh(self) -> None:
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            return
        if mtime == self._listing_mtime:
            return
        self._listing_mtime = mtime
        names = {p.name for p in self.directory.glob(f"*{SUFFIX}") if not p.name.startswith(".")}
        for gone in set(self._index) - names:
            del self._index[gone]
            self._failed.pop(gone, None)
        self._skipped &= names
        for name in names - set(self._index) - self._skipped:
            path = self.directory / name
            try:
                meta = _read_metadata(path)
                written_as = str(meta.get("0.format") or "")
                if written_as != FORMAT:
                    if written_as.startswith(FORMAT_FAMILY):  # ours, by an earlier engine: never served, so freed
                        log.info("prompt cache: deleting %s, written in the older format %s", name, written_as)
                        self._doomed.append(path)
                    self._skipped.add(name)
                    continue
                tokens = np.frombuffer(base64.b64decode(meta["0.tokens"]), dtype="<i4")
                if not name.startswith(_entry_digest(meta["0.key"], tokens) + "-"):
                    raise ValueError("its name is not the digest of its key and tokens")  # copied or renamed
                self._index[name] = DiskEntry(path, meta["0.key"], tokens, meta["0.trimmable"] == "1",
                                              path.stat().st_size)
            except FileNotFoundError:
                continue
            except Exception as exc:  # a foreign or broken file: never ours to serve
                self._skipped.add(name)
                log.warning("prompt cache: skipping %s: %s", path, exc)

    def nbytes(self) -> int:
        with self._lock:  # `/stats` asks from the io thread while the writer adds files
            return sum(entry.nbytes for entry in self._index.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # -- reading --------------------------------------------------------------------------------
    def best_match(self, key: str, tokens: np.ndarray, at_least: int) -> tuple[DiskEntry, int] | None:
        """The stored entry covering the most of `tokens`, if it covers more than `at_least` + min_tokens."""
        with self._lock:
            self._refresh()
            now = time.monotonic()
            entries = [entry for entry in self._index.values()
                       if now - self._failed.get(entry.path.name, -RETRY_AFTER_SECONDS) >= RETRY_AFTER_SECONDS]
        self._unlink_doomed()  # files of an older format `_refresh` found
        best = longest_prefix(((entry, entry.tokens, entry.trimmable) for entry in entries if entry.key == key), tokens)
        return best if best is not None and best[1] >= at_least + self.min_tokens else None

    def pending_match(self, key: str, tokens: np.ndarray) -> tuple[Spill, int] | None:
        """The entry handed to `writer` and not written yet that covers the most of `tokens` (still in memory)."""
        return longest_prefix(((spill, spill.tokens, spill.trimmable) for spill in self.writer.pending()
                               if spill.key == key), tokens)

    def faster_to_load(self, entry: DiskEntry, saved_tokens: int, prefill_tokens_per_second: float | None) -> bool:
        """Reading the file beats prefilling `saved_tokens`, by the speeds measured so far."""
        if not prefill_tokens_per_second:
            return True  # nothing measured yet: a prefix worth storing is worth trying
        return entry.nbytes / self.read_bytes_per_second < saved_tokens / prefill_tokens_per_second

    def worth_loading(self, entry: DiskEntry, saved_tokens: int, prefill_tokens_per_second: float | None) -> bool:
        """`faster_to_load`, counting the entries it passes over (`skipped_slower`)."""
        if self.faster_to_load(entry, saved_tokens, prefill_tokens_per_second):
            return True
        self.skipped_slower += 1
        return False

    def load(self, entry: DiskEntry, layout: Layout | None = None) -> list[Any] | None:
        """The entry's KV, after checking its content hash, its length and (given the model's `layout`) its
        layout; None (and the file deleted) when it is damaged or does not fit the model."""
        started = time.perf_counter()
        try:
            if not _is_regular(entry.path):
                raise ValueError("not a regular file")
            if content_hash(entry.path) != entry.path.stem.rsplit("-", 1)[-1]:
                raise ValueError("content hash mismatch")
            cache = load_prompt_cache(str(entry.path))
            # Read here (the reader's thread, `DiskReads`), not at the cache's first use on the mlx thread.
            mx.eval(_arrays(cache))
            _check_lengths(cache, len(entry.tokens))
            problem = mismatch(cache, layout) if layout is not None else None
            if problem:
                raise ValueError(f"its KV does not fit the model: {problem}")
        except Exception as exc:
            if not os.path.lexists(entry.path):  # deleted meanwhile (the byte cap, here or in another engine)
                with self._lock:
                    self._index.pop(entry.path.name, None)
                return None
            if _out_of_resources(exc):  # the machine's failure, not the file's: it stays for a later request
                with self._lock:
                    self.read_failures += 1
                    self._failed[entry.path.name] = time.monotonic()
                log.warning("prompt cache: could not read %s (%s): kept, not tried again for %.0f s; the prompt is "
                            "prefilled", entry.path.name, exc, RETRY_AFTER_SECONDS)
                return None
            with self._lock:
                self.corrupt += 1
            log.warning("prompt cache: %s is damaged (%s): skipped and deleted", entry.path.name, exc)
            self._delete(entry)
            return None
        seconds = max(time.perf_counter() - started, 1e-6)
        self.read_bytes_per_second += 0.5 * (entry.nbytes / seconds - self.read_bytes_per_second)
        with self._lock:
            self.hits += 1
            self.tokens_loaded += len(entry.tokens)
        try:
            os.utime(entry.path)  # most recently used: the last to go under the byte cap
        except OSError:
            pass
        return cache

    # -- writing --------------------------------------------------------------------------------
    def store_later(self, key: str, tokens: np.ndarray, cache: list[Any], trimmable: bool) -> bool:
        """Hands an entry to `writer` (`store` on its thread); False when it would not be written anyway.

        Its arrays are scheduled here, on the caller's (the mlx) thread, and only waited for on the
        writer's: a cache built lazily (the vision tier's concatenated blocks, a finished request's
        KV copied out of the batch) must not be built into a graph on another thread. Scheduled, not
        evaluated: waiting here for a finished request's 0.4 GB copy held the mlx thread 1.4 s
        (`wide-kv` bench model); on the CPU that copy still runs on its stream before the next
        step's work, so the step waits for it instead.
        """
        if len(tokens) < self.min_tokens or not cache:
            return False
        size = _cache_nbytes(cache)
        if size > self.max_bytes:
            return False
        try:
            started = time.perf_counter()
            mx.async_eval(_arrays(cache))
            self.writer.submit(Spill(key, np.array(tokens, dtype=np.int32), cache, trimmable, size))
            log.debug("prompt cache: %d tokens' KV handed to the writer in %.0f ms", len(tokens),
                      (time.perf_counter() - started) * 1000)
        except Exception as exc:  # the cache is an optimisation: an eviction never fails its caller
            log.warning("prompt cache: could not hand an entry of %d tokens to the writer: %s", len(tokens), exc)
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Waits for the entries handed to `writer` (a model switch, a clean shutdown)."""
        return self.writer.flush(timeout)

    def store(self, key: str, tokens: np.ndarray, cache: list[Any], trimmable: bool) -> bool:
        """Writes an entry (unless stored already or too short); atomic, then the cap is enforced."""
        if len(tokens) < self.min_tokens or not cache:
            return False
        digest = _entry_digest(key, tokens)
        size = _cache_nbytes(cache)
        if size > self.max_bytes:
            return False  # would only be written to be deleted, past the cap meanwhile
        with self._lock:
            if any(name.startswith(digest) for name in self._index):
                return False
            self._enforce_cap_locked(room_for=size)  # room first: the directory stays under the cap while written
        self._unlink_doomed()
        started = time.perf_counter()
        temporary = self.directory / f".{digest}-{uuid.uuid4().hex}.tmp{SUFFIX}"
        meta = {"format": FORMAT, "key": key, "trimmable": "1" if trimmable else "0",
                "tokens": base64.b64encode(tokens.astype("<i4").tobytes()).decode()}
        try:
            mx.eval(_arrays(cache))  # on the writer's thread: waits for what `store_later` scheduled
            save_prompt_cache(str(temporary), cache, meta)
            final = self.directory / f"{digest}-{content_hash(temporary)}{SUFFIX}"
            os.replace(temporary, final)
        except Exception as exc:
            log.warning("prompt cache: could not write an entry of %d tokens: %s", len(tokens), exc)
            temporary.unlink(missing_ok=True)
            return False
        with self._lock:
            self._index[final.name] = DiskEntry(final, key, tokens.copy(), trimmable, final.stat().st_size)
            self.writes += 1
            self._enforce_cap_locked(0)
            kept = final.name in self._index
        self._unlink_doomed()
        log.debug("prompt cache: wrote %d tokens' KV (%.0f MB) in %.2f s on %s", len(tokens), size / 1e6,
                  time.perf_counter() - started, threading.current_thread().name)
        return kept

    def _enforce_cap(self, room_for: int = 0) -> None:
        """Deletes least recently used files (by mtime, which loads refresh) until the directory fits,
        with `room_for` bytes to spare; temporary files left by a crashed write go too."""
        with self._lock:
            self._enforce_cap_locked(room_for)
        self._unlink_doomed()

    def _unlink_doomed(self) -> None:
        """Unlinks the files the cap took out of the index, outside the lock (`/stats` and admissions wait on it)."""
        while self._doomed:
            try:
                self._doomed.pop().unlink()
            except (FileNotFoundError, IndexError):
                pass

    def _enforce_cap_locked(self, room_for: int) -> None:
        self._listing_mtime = -1
        self._refresh()
        self._sweep_stale_temporaries()
        if self.nbytes() + room_for <= self.max_bytes:
            return
        def last_used(entry: DiskEntry) -> float:
            try:
                return entry.path.stat().st_mtime
            except OSError:
                return 0.0
        for entry in sorted(self._index.values(), key=last_used):
            if self.nbytes() + room_for <= self.max_bytes:
                break
            self._index.pop(entry.path.name, None)
            self._doomed.append(entry.path)  # unlinked by `_unlink_doomed`, once the lock is let go

    def _sweep_stale_temporaries(self) -> None:
        """`.<digest>-<uuid>.tmp.safetensors` older than STALE_TEMPORARY_SECONDS: a write that never finished
        (another engine's write in progress is younger)."""
        cutoff = time.time() - STALE_TEMPORARY_SECONDS
        for path in self.directory.glob(f".*.tmp{SUFFIX}"):
            try:
                if _is_regular(path) and path.stat().st_mtime < cutoff:
                    path.unlink()
                    log.info("prompt cache: removed %s, left by a write that never finished", path.name)
            except OSError:
                continue

    def _delete(self, entry: DiskEntry) -> None:
        with self._lock:
            self._index.pop(entry.path.name, None)
        try:
            entry.path.unlink()
        except FileNotFoundError:
            pass

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, int]:
        return {"prompt_cache_disk_entries": len(self._index), "prompt_cache_disk_bytes": self.nbytes(),
                "prompt_cache_disk_hits": self.hits, "prompt_cache_disk_writes": self.writes,
                "prompt_cache_disk_corrupt": self.corrupt, "prompt_cache_disk_read_failures": self.read_failures,
                "prompt_cache_disk_tokens_loaded": self.tokens_loaded,
                "prompt_cache_disk_skipped_slower": self.skipped_slower,
                "prompt_cache_disk_spills_queued": self.writer.queued,
                "prompt_cache_disk_spills_waited": self.writer.waited}
