"""Model loading settings and download progress, without processes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from engine_daemon.cli import build_parser


def test_model_environment_equivalents(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLX_ENGINE_MODEL", "PRELOAD_MODEL", "MLX_VLM_PRELOAD_MODEL"):
        monkeypatch.delenv(name, raising=False)
    assert build_parser().parse_args([]).model is None
    monkeypatch.setenv("MLX_VLM_PRELOAD_MODEL", "org/vlm")
    assert build_parser().parse_args([]).model == "org/vlm"
    monkeypatch.setenv("PRELOAD_MODEL", "org/lm")
    assert build_parser().parse_args([]).model == "org/lm"
    monkeypatch.setenv("MLX_ENGINE_MODEL", "org/engine")
    assert build_parser().parse_args([]).model == "org/engine"
    assert build_parser().parse_args(["--model", "org/flag"]).model == "org/flag"
    monkeypatch.setenv("MLX_ENGINE_IDLE_UNLOAD", "30")
    assert build_parser().parse_args([]).idle_unload == 30.0


def test_download_progress_counts_the_repo_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/health's `downloaded_bytes` while a download runs: the repo's blobs so far, partial ones included."""
    from huggingface_hub import constants

    from engine_daemon.models import store as model_store

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_store.downloaded_bytes("org/model") == 0
    blobs = tmp_path / "models--org--model" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "aaaa").write_bytes(b"x" * 1000)
    (blobs / "bbbb.incomplete").write_bytes(b"x" * 24)
    assert model_store.downloaded_bytes("org/model") == 1024
    # A failed download (here: a Hub that refuses connections) leaves no download marked in progress.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
        monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
        with pytest.raises(model_store.ModelNotFound, match="could not be downloaded"):
            model_store.resolve("org/other-model", allow_download=True)
    assert model_store.downloading is None
