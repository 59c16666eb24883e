"""Writing a model directory safely: atomic files, a build lock, and the complete-build check.

Shared by every builder: `config.json` is written last and acts as the commit marker, so a
crashed or concurrent build is never mistaken for a finished one, and a directory holding
something else (a real model) is never overwritten.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MARKER_KEY = "mlx_engined_random_weights"
BUILD_INFO_KEY = "mlx_engined_build"

# Files of a complete build. config.json is written last and acts as the commit marker.
PAYLOAD_FILES = (
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "README.md",
)
_CONFIG_FILE = "config.json"
_LOCK_FILE = ".mlx_engined_build.lock"


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_complete_build(out_dir: Path, expected: dict, payload_files: tuple[str, ...] = PAYLOAD_FILES) -> bool:
    """True when out_dir holds a finished build of exactly ``expected`` (config incl. build info)."""
    on_disk = read_json(out_dir / _CONFIG_FILE)
    if on_disk is None:
        return False
    info = dict(on_disk.get(BUILD_INFO_KEY) or {})
    manifest = info.pop("files", None)
    if not isinstance(manifest, dict) or {**on_disk, BUILD_INFO_KEY: info} != expected:
        return False
    for name in payload_files:
        try:
            if (out_dir / name).stat().st_size != manifest.get(name):
                return False
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Serialises concurrent builds of one directory (e.g. pytest-xdist workers)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(out_dir / _LOCK_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_build(out_dir: Path, config: dict, payload_files: tuple[str, ...],
                write_payload: Callable[[Path], None]) -> bool:
    """The idempotent build protocol every builder shares; True when it built, False when it reused.

    A complete build is detected from config.json (written last, atomically, with the
    builder version and a size manifest of the payload files), so a crashed or partial
    build is never mistaken for a finished one and is simply rebuilt. A directory whose
    config.json is not one of ours is refused rather than overwritten, so a real
    checkpoint cannot be clobbered. Concurrent builders of one directory serialise.
    """
    if _is_complete_build(out_dir, config, payload_files):
        return False
    existing = read_json(out_dir / _CONFIG_FILE)
    if (out_dir / _CONFIG_FILE).exists() and not (existing or {}).get(MARKER_KEY):
        raise FileExistsError(f"{out_dir} holds a config.json not written by a builder; refusing to overwrite it")
    out_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        if _is_complete_build(out_dir, config, payload_files):  # another process finished it meanwhile
            return False
        # Invalidate first: from here until the final config.json write the dir is "incomplete".
        (out_dir / _CONFIG_FILE).unlink(missing_ok=True)
        write_payload(out_dir)
        final = copy.deepcopy(config)
        final[BUILD_INFO_KEY]["files"] = {name: (out_dir / name).stat().st_size for name in payload_files}
        atomic_write_json(out_dir / _CONFIG_FILE, final)
    return True


def save_weights(out_dir: Path, weights: dict) -> int:
    """Writes model.safetensors atomically; returns the parameter count."""
    import mlx.core as mx

    n_params = sum(int(w.size) for w in weights.values())
    tmp = out_dir / f".tmp-{os.getpid()}-model.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, out_dir / "model.safetensors")
    return n_params


def link_or_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".tmp-{os.getpid()}-{dst.name}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
