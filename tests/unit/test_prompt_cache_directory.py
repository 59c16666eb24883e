"""`--prompt-cache-dir` is checked at start (`prefix_cache.directory.unusable`): a path that cannot hold files is
refused with one line and exit 2 before MLX or a model loads, not with a traceback once the model has loaded."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine_daemon.cli import main
from engine_daemon.prefix_cache.directory import unusable


def test_a_missing_directory_is_made_and_the_probe_leaves_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "b"
    assert unusable(str(directory)) is None
    assert directory.is_dir() and list(directory.iterdir()) == []
    assert unusable(str(directory)) is None  # an existing one too


def test_a_path_under_a_file_is_unusable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert "cannot write files there" in (unusable(str(tmp_path / "file" / "kv")) or "")
    assert "cannot write files there" in (unusable(str(tmp_path / "file")) or "")


def test_an_existing_directory_that_refuses_writes_is_unusable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only mount or another user's directory (simulated: this suite may run as root, which writes anyway)."""
    import tempfile

    def refused(**_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)
    assert unusable(str(tmp_path)) == "cannot write files there (Permission denied)"


def test_the_engine_refuses_it_at_start_with_exit_2(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "kv")
    with caplog.at_level(logging.ERROR):
        assert main(["--endpoint", f"ipc://{tmp_path}/e.sock", "--prompt-cache-dir", bad]) == 2
    assert any(record.getMessage().startswith(f"--prompt-cache-dir {bad}: cannot write files there")
               for record in caplog.records)
