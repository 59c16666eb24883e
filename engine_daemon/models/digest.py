"""A cheap digest of a checkpoint's weights: what the ranks of an engine group compare at start.

Why: every rank loads the model from its own disk. A rank started on another directory,
or on the same architecture with other weights, shards and runs without complaint, and
its output is garbage that only the first token checksum notices (after the group was
reported healthy and served). Comparing a digest at start refuses such a group at once.

Why a sample: hashing every byte of a 60 GB checkpoint would add minutes to a start. The
digest covers the parsed config.json and tokenizer.json, every tensor's name, dtype and
shape (from the safetensors headers, whatever the file split) and SAMPLE_BYTES at the start,
middle and end of each tensor's data: a few small reads per tensor, from pages the load
has just read. Independent of the rank and the mode (each rank hashes the whole
checkpoint's files, not its shard), so every rank of a sound group computes the same value.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SAMPLE_BYTES = 32
MAX_HEADER = 100 * 2**20  # a safetensors header larger than this is not one


def weights_digest(path: str | Path) -> str:
    """16 hex digits; files mlx-lm loads (config.json, model*.safetensors) and the tokenizer's vocabulary."""
    root = Path(path)
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        try:
            text = (root / name).read_text()
        except OSError:
            digest.update(f"{name}:missing\n".encode())
            continue
        try:  # parsed: the same settings written with other whitespace or key order are the same model
            text = json.dumps(json.loads(text), sort_keys=True)
        except ValueError:
            pass
        digest.update(f"{name}:{hashlib.sha256(text.encode()).hexdigest()}\n".encode())
    tensors: list[tuple[str, str]] = []
    for file in sorted(root.glob("model*.safetensors")) or sorted(root.glob("*.safetensors")):
        try:
            tensors += _sampled_tensors(file)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # mlx-lm loaded it: a copy that differs, say
            tensors.append((file.name, f"unreadable: {type(exc).__name__}"))
    for name, line in sorted(tensors):
        digest.update(f"{name} {line}\n".encode())
    return digest.hexdigest()[:16]


def _sampled_tensors(file: Path) -> list[tuple[str, str]]:
    """(tensor name, "dtype shape sample-hash") for each tensor of one safetensors file."""
    with file.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        if size > MAX_HEADER:
            raise ValueError(f"{file}: not a safetensors file")
        header = json.loads(handle.read(size))
        base = 8 + size
        found = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            sample = hashlib.sha256()
            for offset in sorted({start, max(start, (start + end) // 2 - SAMPLE_BYTES // 2),
                                  max(start, end - SAMPLE_BYTES)}):
                handle.seek(base + offset)
                sample.update(handle.read(min(SAMPLE_BYTES, end - offset)))
            found.append((name, f"{info['dtype']} {info['shape']} {sample.hexdigest()[:16]}"))
        return found
