"""A built model laid out exactly like `huggingface_hub`'s cache (`place_in_hf_cache`).

So code paths that resolve repo ids (`snapshot_download(..., local_files_only=True)`,
`scan_cache_dir`) can be tested offline: blobs named by sha256 (LFS) or git blob sha1,
relative snapshot symlinks, refs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from model_builders.files import atomic_write_bytes, atomic_write_json, link_or_copy

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# Hugging Face cache layout
# --------------------------------------------------------------------------------------

_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".npz", ".pt", ".pth", ".model", ".tiktoken")
_LFS_MIN_SIZE = 10 * 1024 * 1024
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def _hash_file(path: Path, algo: str, prefix: bytes = b"") -> str:
    h = hashlib.new(algo)
    h.update(prefix)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_sha1(data_or_path: bytes | Path) -> str:
    if isinstance(data_or_path, bytes):
        return hashlib.sha1(b"blob %d\0" % len(data_or_path) + data_or_path).hexdigest()
    size = data_or_path.stat().st_size
    return _hash_file(data_or_path, "sha1", b"blob %d\0" % size)


def _check_resolves(repo_id: str, cache_dir: Path, revision: str, snapshot: Path) -> None:
    """Fails loudly if huggingface_hub itself would not resolve what we just laid out."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub comes with mlx-lm
        return
    resolved = snapshot_download(repo_id, cache_dir=cache_dir, revision=revision, local_files_only=True)
    if Path(resolved).resolve() != snapshot.resolve():
        raise RuntimeError(f"huggingface_hub resolved {repo_id}@{revision} to {resolved}, not {snapshot}")


def place_in_hf_cache(model_dir: str | Path, repo_id: str, cache_dir: str | Path, revision: str = "main") -> Path:
    """Lays the model out exactly as huggingface_hub lays out its cache; returns the snapshot dir.

    The layout: <cache_dir>/models--<org>--<name>/{blobs/<sha256 or git-sha1 of file>,
    snapshots/<40-hex commit>/<file> -> symlinks to ../../blobs/..., refs/<revision> containing the
    commit hash}. `huggingface_hub.scan_cache_dir(cache_dir)` sees the repo, and
    `huggingface_hub.snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)` returns
    the snapshot path.

    Why: lets the engine's "resolve a Hub repo id offline" paths be tested with a real
    cache layout. Details that mirror a real download: large/binary files are LFS objects
    whose blob is named by the sha256 of the content, other files by their git blob sha1;
    ``trees/<commit>.json`` (huggingface_hub >= 1.x tree-listing cache) records every file so
    completeness checks pass; the commit hash is derived from the file list and contents, so
    placing the same model twice is a no-op and a different model gets a new snapshot.
    Hidden files (e.g. the build lock) are skipped. Blobs are hard links when possible.
    If ``revision`` is itself a 40-hex commit hash it is used as the snapshot name.
    """
    model_dir = Path(model_dir).expanduser().resolve()
    cache_dir = Path(cache_dir).expanduser().resolve()
    if repo_id.count("/") > 1 or not repo_id.strip("/") or ".." in repo_id:
        raise ValueError(f"invalid repo_id {repo_id!r}")
    files = sorted(
        p
        for p in model_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(model_dir).parts)
    )
    if not files:
        raise FileNotFoundError(f"no files to place in {model_dir}")

    entries: dict[str, dict] = {}
    for path in files:
        rel = path.relative_to(model_dir).as_posix()
        size = path.stat().st_size
        if path.suffix in _LFS_SUFFIXES or size >= _LFS_MIN_SIZE:
            sha256 = _hash_file(path, "sha256")
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
            entries[rel] = {
                "path": path,
                "blob": sha256,
                "tree": {"size": size, "blob_id": _git_blob_sha1(pointer), "lfs_sha256": sha256, "lfs_size": size},
            }
        else:
            sha1 = _git_blob_sha1(path)
            entries[rel] = {"path": path, "blob": sha1, "tree": {"size": size, "blob_id": sha1}}

    if _COMMIT_RE.match(revision):
        commit = revision
    else:
        manifest = "\n".join(f"{rel} {e['tree']['blob_id']}" for rel, e in sorted(entries.items()))
        commit = hashlib.sha1(f"mlx-engined random model\n{repo_id}\n{manifest}\n".encode()).hexdigest()

    repo_root = cache_dir / ("models--" + repo_id.replace("/", "--"))
    blobs = repo_root / "blobs"
    snapshot = repo_root / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)

    for rel, e in entries.items():
        blob = blobs / e["blob"]
        if not blob.exists() or blob.stat().st_size != e["tree"]["size"]:
            link_or_copy(e["path"], blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(blob, link.parent)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        tmp = link.with_name(f".tmp-{os.getpid()}-{link.name}")
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, link)

    trees = repo_root / "trees"
    trees.mkdir(exist_ok=True)
    atomic_write_json(
        trees / f"{commit}.json",
        {"format_version": 1, "files": {rel: entries[rel]["tree"] for rel in sorted(entries)}},
    )
    if not _COMMIT_RE.match(revision):
        ref = repo_root / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(ref, commit.encode())  # no trailing newline, as huggingface_hub writes it
    _check_resolves(repo_id, cache_dir, revision, snapshot)
    logger.info("placed %s as %s@%s in %s", model_dir, repo_id, revision, snapshot)
    return snapshot
