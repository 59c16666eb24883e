"""The default engine endpoint, shared so both sides agree without configuration."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ENDPOINT_ENV = "MLX_ENGINE_ENDPOINT"


def runtime_dir() -> Path:
    """A per-user directory for the ipc socket and its lock ($XDG_RUNTIME_DIR when set).

    Kept short: macOS limits Unix socket paths to ~104 bytes.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir():
        return Path(base) / "mlx-engined"
    return Path(tempfile.gettempdir()) / f"mlx-engined-{os.getuid()}"


def default_endpoint() -> str:
    """$MLX_ENGINE_ENDPOINT, else an ipc:// socket in the user's runtime directory."""
    return os.environ.get(ENDPOINT_ENV) or f"ipc://{runtime_dir() / 'engine.sock'}"
