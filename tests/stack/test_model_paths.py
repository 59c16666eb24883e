"""Request model names are confined to --model-dir roots and the HF cache (real engine + front-end)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine_daemon.models.store import InvalidModelName, ModelNotFound, model_roots, resolve
from tests.helpers import Engine, Frontend, running_stack


@pytest.fixture(scope="module")
def root(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model root holding one model, a non-model directory and a symlink that leads out of the root."""
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(tiny_model, root / "tiny")
    (root / "notes").mkdir()
    (root / "escape").symlink_to(tiny_model, target_is_directory=True)  # a valid model, outside the root
    return root


@pytest.fixture(scope="module")
def served(root: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Frontend]]:
    logs = tmp_path_factory.mktemp("paths-logs")
    empty_cache = tmp_path_factory.mktemp("empty-hub")
    empty_root = tmp_path_factory.mktemp("empty-root")
    # Two roots through the environment (os.pathsep-separated); test_operations uses the flag.
    with running_stack(f"ipc://{ipc_dir}/paths.sock", logs,
                       env={"MLX_ENGINE_MODEL_DIRS": f"{empty_root}{os.pathsep}{root}",
                            "HF_HUB_CACHE": str(empty_cache), "HF_HUB_OFFLINE": "1"}) as stack:
        yield stack


def chat(frontend: Frontend, model: str) -> httpx.Response:
    return httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("name", ["../../etc", "/etc", "/tmp/../etc/passwd", "tiny/../../etc", "escape",
                                  "..", "~/../../etc"])
def test_names_reaching_outside_the_roots_get_400(served: tuple[Engine, Frontend], name: str) -> None:
    engine, frontend = served
    r = chat(frontend, name)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_model_name" and error["param"] == "model"
    assert error["type"] == "invalid_request_error"


def test_a_model_outside_the_roots_is_never_loaded(served: tuple[Engine, Frontend], tiny_model: Path,
                                                   root: Path) -> None:
    engine, frontend = served
    # tiny_model is a loadable MLX model: only the fence stops it, by absolute path or via `..`.
    for name in (str(tiny_model), f"{root}/../{tiny_model.parent.name}/{tiny_model.name}"):
        r = chat(frontend, name)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_model_name", r.text
    assert str(tiny_model) not in engine.log()  # no load attempt, not even a log line naming it


def test_names_under_a_root_load(served: tuple[Engine, Frontend], root: Path) -> None:
    engine, frontend = served
    r = chat(frontend, "tiny")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"
    r = chat(frontend, str(root / "tiny"))  # an absolute path inside a root
    assert r.status_code == 200, r.text
    listed = httpx.get(f"{frontend.base_url}/v1/models", timeout=30).json()["data"]
    assert "tiny" in [m["id"] for m in listed]
    assert "escape" not in [m["id"] for m in listed] and "notes" not in [m["id"] for m in listed]
    loads = [line for line in engine.log().splitlines() if "loading model" in line]
    assert loads and all(f"from {root.resolve()}/tiny" in line for line in loads)


def test_unknown_names_get_404_listing_what_is_available(served: tuple[Engine, Frontend]) -> None:
    _, frontend = served
    for name in ("no-such-model", "no-such-org/no-such-model", "notes"):
        r = chat(frontend, name)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "Available models: tiny" in error["message"]


# -- the resolver itself (no engine): the cases that HTTP cannot easily reach ----------------------------
def test_resolver_edge_cases(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    roots = model_roots([str(root)])
    assert resolve("tiny", roots=roots).path == (root / "tiny").resolve()
    assert resolve(f"{root}/tiny/", roots=roots).path == (root / "tiny").resolve()
    for bad in ("", "tiny\0", "a/../tiny", "..\\..\\etc", str(tmp_path)):
        with pytest.raises(InvalidModelName):
            resolve(bad, roots=roots)
    with pytest.raises(InvalidModelName):  # no roots: every local path is refused
        resolve(str(root / "tiny"), roots=())
    with pytest.raises(ModelNotFound):
        resolve("tiny", roots=())
    # The operator's --model (roots=None) may still be any local directory.
    assert resolve(str(root / "tiny")).path == (root / "tiny").resolve()
    # Several roots: a name is looked up in each, in order.
    other = tmp_path / "other"
    other.mkdir()
    two = model_roots([str(other), str(root)])
    assert resolve("tiny", roots=two).path == (root / "tiny").resolve()
