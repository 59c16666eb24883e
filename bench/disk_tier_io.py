"""The disk tier's write and load of one large entry, with its content hash as SHA-256 (format 1) and XXH3-128 (now).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/disk_tier_io.py --rounds 6

In process: a real `DiskTier` in a temporary directory stores an evicted entry's KV (`--layers`
layers of `--kv-heads` x `--tokens` x `--head-dim` float32 keys and values: ~0.8 GB by default,
an agent's ~4,000-token prefix on a 7-8B-shaped model) and loads it back, once with each hash,
alternated. Every load hashes the whole file and every write hashes what it wrote, so the hash
is paid once per write and once per load; a load's time is what a request waiting on a disk
prefix waits for (`DiskReads`). The file is fresh in the page cache as after a spill, so the
figures are the hash and the (de)serialisation, not the drive. Writes
bench/results/disk_tier_io.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from engine_daemon.prefix_cache import disk
from engine_daemon.prefix_cache.disk import DiskTier, key_digest

HERE = Path(__file__).resolve().parent


def sha256_hash(path: Path) -> str:
    """Format 1's content hash."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:32]


HASHES = {"sha256": sha256_hash, "xxh3_128": disk.content_hash}


def entry(layers: int, kv_heads: int, tokens: int, head_dim: int) -> list[KVCache]:
    caches = []
    for _ in range(layers):
        cache = KVCache()
        keys = mx.random.normal((1, kv_heads, tokens, head_dim))
        cache.update_and_fetch(keys, keys * 2)
        caches.append(cache)
    mx.eval([cache.state for cache in caches])
    return caches


def one_round(root: Path, name: str, cache: list[KVCache], tokens: int) -> dict[str, float]:
    """Stores and loads the entry with hash `name`; seconds for each, and for the hash alone."""
    disk.content_hash = HASHES[name]
    tier = DiskTier(root / name, max_bytes=1 << 40, min_tokens=16)
    key, prompt = key_digest("bench-model", None), np.arange(tokens, dtype=np.int32)
    started = time.perf_counter()
    assert tier.store(key, prompt, cache, trimmable=True)
    write = time.perf_counter() - started
    found = tier.best_match(key, np.arange(tokens + 8, dtype=np.int32), at_least=0)
    assert found is not None
    started = time.perf_counter()
    assert tier.load(found[0]) is not None
    load = time.perf_counter() - started
    started = time.perf_counter()
    HASHES[name](found[0].path)
    hashing = time.perf_counter() - started
    size = found[0].path.stat().st_size
    found[0].path.unlink()
    return {"write_s": write, "load_s": load, "hash_s": hashing, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    original = disk.content_hash
    cache = entry(args.layers, args.kv_heads, args.tokens, args.head_dim)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in HASHES}
    try:
        with tempfile.TemporaryDirectory(prefix="disk-tier-io-") as root:
            for number in range(args.rounds):
                for name in HASHES:
                    result = one_round(Path(root), name, cache, args.tokens)
                    rounds[name].append(result)
                    print(f"round {number} {name}: {result['bytes'] / 1e9:.2f} GB, write {result['write_s']:.2f} s, "
                          f"load {result['load_s']:.2f} s, hash alone {result['hash_s']:.3f} s", flush=True)
    finally:
        disk.content_hash = original
    summary = {name: {field: statistics.median(r[field] for r in results) for field in ("write_s", "load_s", "hash_s")}
               for name, results in rounds.items()}
    for name, medians in summary.items():
        print(f"{name}: median write {medians['write_s']:.2f} s, load {medians['load_s']:.2f} s, "
              f"hash {medians['hash_s']:.3f} s")
    out = HERE / "results" / "disk_tier_io.json"
    out.write_text(json.dumps({"args": vars(args), "rounds": rounds, "medians": summary}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
