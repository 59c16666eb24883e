"""Whether `--prompt-cache-dir` can hold the disk tier, checked before the engine loads anything.

Why: the directory was first touched when the scheduler built its `DiskTier`, after MLX and the
model had loaded, and a path under a file or on a read-only mount ended the engine with a
traceback (rc 1), or, when it existed but could not be written, with a warning at every eviction
and a clean stop that saved nothing. An operator's mistake is refused at start with one line and
exit 2, as the other flags' are. No MLX here: `engined` checks its flags before importing it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def unusable(directory: str) -> str | None:
    """Why `directory` cannot hold cache files (made if missing), or None when a file can be written there."""
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-", suffix=".tmp"):
            pass
    except OSError as exc:
        return f"cannot write files there ({exc.strerror or exc})"
    return None
