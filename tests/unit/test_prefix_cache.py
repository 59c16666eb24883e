"""The prefix cache's tiers without processes: real mlx KV caches, a temporary directory."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from engine_daemon.models.identity import model_identity
from engine_daemon.prefix_cache.disk import DiskTier, key_digest
from engine_daemon.prefix_cache.memory import MemoryTier
from engine_daemon.prefix_cache.tiered import PrefixCache

KEY = ("model-identity", None)


def kv(tokens: int, seed: int = 0, layers: int = 2) -> list[KVCache]:
    """A two-layer KV cache holding `tokens` positions of seeded random keys/values."""
    caches = []
    for layer in range(layers):
        cache = KVCache()
        keys = mx.random.normal((1, 2, tokens, 32), key=mx.random.key(seed * 10 + layer))
        cache.update_and_fetch(keys, keys * 2)
        caches.append(cache)
    return caches


def same(a: list[KVCache], b: list[KVCache], length: int) -> bool:
    return all(x.offset == y.offset == length and mx.array_equal(x.state[0], y.state[0]).item() for x, y in zip(a, b))


def test_memory_tier_reuses_the_longest_prefix_and_trims_longer_entries() -> None:
    tier = MemoryTier(max_entries=8, max_bytes=1 << 40)
    tier.insert(KEY, list(range(100)), kv(100))
    tier.insert(KEY, list(range(300)), kv(300, seed=1))  # its prefixes are dropped: it serves them
    assert len(tier) == 1
    match = tier.best_match(KEY, np.arange(200, dtype=np.int32))
    assert match is not None and match.length == 200
    cache = tier.take(match)
    assert cache[0].offset == 200 and tier.entries()[0].cache[0].offset == 300  # a copy was cut, not the entry
    assert tier.best_match(("other model", None), np.arange(200, dtype=np.int32)) is None


def test_memory_tier_evicts_least_recently_used_into_the_callback() -> None:
    evicted: list[int] = []
    tier = MemoryTier(max_entries=2, max_bytes=1 << 40, on_evict=lambda e: evicted.append(int(e.tokens[0])))
    for start in (1000, 2000, 3000):
        tier.insert(KEY, list(range(start, start + 10)), kv(10))
    assert evicted == [1000] and len(tier) == 2


def test_disk_round_trip_and_stale_keys(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    original = kv(400)
    assert disk.store(key_digest("weights-a", None), np.arange(400, dtype=np.int32), original, trimmable=True)
    fresh = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)  # another process, later
    prompt = np.arange(1000, dtype=np.int32)
    found = fresh.best_match(key_digest("weights-a", None), prompt, at_least=0)
    assert found is not None and found[1] == 400
    assert same(fresh.load(found[0]), original, 400)
    # Other weights (changed files: another identity) or another adapter never match.
    assert fresh.best_match(key_digest("weights-b", None), prompt, at_least=0) is None
    assert fresh.best_match(key_digest("weights-a", "/adapters/x"), prompt, at_least=0) is None


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_file_is_skipped_and_deleted(tmp_path: Path, damage: str) -> None:
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    disk.store(key_digest("w", None), np.arange(300, dtype=np.int32), kv(300), trimmable=True)
    (path,) = tmp_path.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) - 100]
    path.write_bytes(bytes(data))
    found = disk.best_match(key_digest("w", None), np.arange(500, dtype=np.int32), at_least=0)
    assert found is not None and disk.load(found[0]) is None
    assert disk.corrupt == 1 and not path.exists() and len(disk) == 0


def test_the_byte_cap_holds(tmp_path: Path) -> None:
    one = DiskTier(tmp_path / "probe", max_bytes=1 << 30, min_tokens=16)
    one.store("k", np.arange(300, dtype=np.int32), kv(300), trimmable=True)
    size = one.nbytes()
    disk = DiskTier(tmp_path / "capped", max_bytes=int(size * 3.5), min_tokens=16)
    for i in range(8):
        disk.store("k", np.arange(i * 1000, i * 1000 + 300, dtype=np.int32), kv(300, seed=i), trimmable=True)
        assert disk.nbytes() <= disk.max_bytes
        assert sum(p.stat().st_size for p in (tmp_path / "capped").iterdir()) <= disk.max_bytes
    assert len(disk) == 3


def test_two_engines_sharing_a_directory_do_not_corrupt_each_other(tmp_path: Path) -> None:
    tiers = [DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16) for _ in range(2)]
    originals = {i: kv(200, seed=i) for i in range(6)}
    mx.eval([c.state for caches in originals.values() for c in caches])

    def write(tier: DiskTier, ids: range) -> None:
        for i in ids:
            tier.store("k", np.arange(i * 500, i * 500 + 200, dtype=np.int32), originals[i], trimmable=True)

    threads = [threading.Thread(target=write, args=(tiers[0], range(0, 6))),
               threading.Thread(target=write, args=(tiers[1], range(3, 6)))]  # the same entries, at once
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reader = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind
    for i, original in originals.items():
        found = reader.best_match("k", np.arange(i * 500, i * 500 + 400, dtype=np.int32), at_least=0)
        assert found is not None and same(reader.load(found[0]), original, 200)
    assert reader.corrupt == 0


def test_tiers_together_and_the_identity_of_weights(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    identity = model_identity(model)
    cache = PrefixCache(max_entries=1, max_bytes=1 << 40, disk=DiskTier(tmp_path / "disk", 1 << 30, min_tokens=16))
    key = (identity, None)
    cache.insert(key, list(range(300)), kv(300))
    cache.insert(key, list(range(5000, 5300)), kv(300, seed=3))  # evicts the first one to disk
    assert cache.disk.flush(timeout=60)  # written by the tier's writer thread
    found, length = cache.fetch(key, list(range(400)))
    assert length == 300 and found[0].offset == 300 and cache.hits["disk"] == 1
    assert cache.spill_all() == 1 and len(cache) == 0
    (model / "model.safetensors").write_bytes(b"new weights!")
    assert model_identity(model) != identity  # changed weights: their old prefixes are never served


def test_the_identity_sees_rewrites_whose_mtime_was_put_back_and_config_changes(tmp_path: Path) -> None:
    """Red team: same-size weights with their mtime restored (`touch -d`), or a changed `rope_theta`, kept the
    identity, so the disk tier served the old weights' KV. ctime, inode and config.json now take part."""
    import os

    model = tmp_path / "model"
    model.mkdir()
    weights, config = model / "model.safetensors", model / "config.json"
    weights.write_bytes(b"weights-1")
    config.write_text('{"rope_theta": 1000000}')
    identity = model_identity(model)
    assert model_identity(model) == identity  # nothing changed: the same key (a restart finds its prefixes)
    before = weights.stat()
    weights.write_bytes(b"weights-2")  # same size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    rewritten = model_identity(model)
    assert rewritten != identity
    config.write_text('{"rope_theta": 10}')
    assert model_identity(model) != rewritten


def test_the_disk_tier_skips_what_is_not_a_plain_file_and_cleans_up(tmp_path: Path, caplog) -> None:
    """Red team: a FIFO named `*.safetensors` hung the engine at start; junk was re-read and logged on every
    refresh; a crashed write's temporary file stayed forever; an entry larger than the cap was written anyway."""
    import logging
    import os
    import time

    directory = tmp_path / "kv"
    directory.mkdir()
    os.mkfifo(directory / "pipe.safetensors")
    (directory / "junk.safetensors").write_bytes(b"not ours")
    stale = directory / ".abc-def.tmp.safetensors"
    stale.write_bytes(b"x" * 1000)
    old = time.time() - 7200
    os.utime(stale, (old, old))
    fresh = directory / ".abc-123.tmp.safetensors"  # another engine's write in progress
    fresh.write_bytes(b"y")
    with caplog.at_level(logging.WARNING, logger="engine_daemon.prefix_cache.disk"):
        tier = DiskTier(directory, max_bytes=300_000, min_tokens=16)  # returns: the FIFO is not opened
        for _ in range(3):
            tier._listing_mtime = -1  # as if the directory changed
            tier.refresh()
    assert sum("junk.safetensors" in record.message for record in caplog.records) == 1
    assert not stale.exists() and fresh.exists()
    assert not tier.store("k", np.arange(300, dtype=np.int32), kv(300, layers=8), trimmable=True)  # > the cap
    assert tier.store("k", np.arange(100, dtype=np.int32), kv(100), trimmable=True)
    assert len(tier) == 1 and tier.nbytes() <= 300_000


def test_an_entry_whose_kv_is_shorter_than_its_tokens_is_never_served(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, max_bytes=1 << 30, min_tokens=16)
    assert disk.store(key_digest("w", None), np.arange(400, dtype=np.int32), kv(300), trimmable=True)
    found = disk.best_match(key_digest("w", None), np.arange(500, dtype=np.int32), at_least=0)
    assert found is not None and found[1] == 400 and disk.load(found[0]) is None
    assert disk.corrupt == 1 and len(disk) == 0


def test_prefixes_are_keyed_on_the_kv_layout() -> None:
    from engine_daemon.prefix_cache.tiered import layout_key

    assert layout_key("w", None) == "w"
    assert len({layout_key("w", None), layout_key("w", 512), layout_key("w", 1024)}) == 3



def test_a_file_of_an_earlier_format_is_deleted_and_a_foreign_one_kept(tmp_path: Path) -> None:
    """Format 2 hashes content with XXH3-128 (`content_hash`): a format-1 file (SHA-256) can never be served, so
    left alone it would fill the disk outside the cap; a file another program wrote under our suffix is not ours
    to delete."""
    import base64
    import hashlib

    from mlx_lm.models.cache import save_prompt_cache

    from engine_daemon.prefix_cache.disk import FORMAT, _entry_digest, _read_metadata, content_hash

    tokens = np.arange(300, dtype=np.int32)
    key = key_digest("w", None)
    meta = {"key": key, "trimmable": "1", "tokens": base64.b64encode(tokens.astype("<i4").tobytes()).decode()}
    directory = tmp_path / "kv"
    directory.mkdir()
    written = {}
    for name, format_name, digest in (("old", "mlx-engined-prefix-1", _entry_digest(key, tokens)),
                                      ("foreign", "someone-elses-kv-3", "f" * 32)):
        scratch = tmp_path / f"{name}.safetensors"
        save_prompt_cache(str(scratch), kv(300), {**meta, "format": format_name})
        written[name] = directory / f"{digest}-{hashlib.sha256(scratch.read_bytes()).hexdigest()[:32]}.safetensors"
        scratch.rename(written[name])

    tier = DiskTier(directory, max_bytes=1 << 30, min_tokens=16)
    assert not written["old"].exists() and written["foreign"].exists() and len(tier) == 0
    assert tier.best_match(key, np.arange(500, dtype=np.int32), at_least=0) is None
    assert tier.store(key, tokens, kv(300), trimmable=True)
    (ours,) = [path for path in directory.glob("*.safetensors") if path != written["foreign"]]
    assert ours.stem.split("-")[-1] == content_hash(ours) and len(content_hash(ours)) == 32
    assert _read_metadata(ours)["0.format"] == FORMAT
    found = tier.best_match(key, np.arange(500, dtype=np.int32), at_least=0)
    assert found is not None and same(tier.load(found[0]), kv(300), 300)
