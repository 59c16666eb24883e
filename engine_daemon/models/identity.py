"""Which weights a model directory holds: the prompt cache's key for KV computed with them.

A prefix's KV is only valid for the exact weights and config that computed it, so the disk
tier (which outlives the process) and the memory tier key entries on this identity. It is
taken from file metadata, before the weights are read (`ModelManager`), so a file changed
during a load gives an identity no later load repeats:
- every weight file (`*.safetensors`) and `config.json` (a changed `rope_theta` or quantization
  changes the KV as surely as new weights): name, size, mtime, inode and ctime. Restoring an
  mtime (`touch -d`, `os.utime`) cannot hide a rewrite: the ctime moves with it;
- `config.json`'s content, hashed (it is small).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_identity(path: str | Path) -> str:
    root = Path(path).resolve()
    parts = [str(root)]
    files = sorted(root.glob("*.safetensors")) + [root / "config.json"]
    for item in files:
        try:
            stat = item.stat()
        except OSError:
            parts.append(f"{item.name}:missing")
            continue
        parts.append(f"{item.name}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}:{stat.st_ctime_ns}")
    try:
        parts.append(hashlib.sha256((root / "config.json").read_bytes()).hexdigest())
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]
