"""Shared fixtures: a tiny random-weight model, and one real engine + front-end per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Engine, Frontend

# The stack modules that take longest (a minute or more each on a 2-core machine: engine groups over the ring
# backend, the disk prompt cache's restarts, fault injection, fuzzing, audio models): with the clients and the
# browser they are `slow`, so `python -m pytest -m "not slow"` runs the rest in under half the suite's time.
SLOW_STACK_MODULES = frozenset({
    "test_groups", "test_prompt_cache_disk", "test_vision_prompt_cache_disk", "test_faults", "test_audio_endpoints",
    "test_fuzz_engine_socket", "test_isolation", "test_openapi", "test_routing", "test_frontend_limits",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tier is the folder: tests/stack gets the `stack` marker, tests/clients `clients`, tests/browser
    `browser` (see pyproject); those two tiers and SLOW_STACK_MODULES get `slow` too."""
    for item in items:
        tier = item.path.parent.name
        if tier in ("stack", "clients", "browser"):
            item.add_marker(tier)
        if tier in ("clients", "browser") or (tier == "stack" and item.path.stem in SLOW_STACK_MODULES):
            item.add_marker("slow")
    # The browser tier runs last: Playwright's sync API runs an asyncio loop in the main thread while it
    # is started, so a browser that fails to stop cleanly can never break a later test's asyncio.run().
    items.sort(key=lambda item: item.path.parent.name == "browser")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_builders.text import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", size="tiny", seed=0)


@pytest.fixture(scope="session")
def ipc_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Short paths: Unix socket paths are limited to ~104 bytes on macOS. Removed at the end: every run
    # would otherwise leave one more directory in the system's temp folder.
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="mlxe-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def engine(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    logs = tmp_path_factory.mktemp("logs")
    # Models built next to the tiny one (variants, a VLM) may be named by requests.
    proc = Engine(f"ipc://{ipc_dir}/shared.sock", logs / "engined.log", model=str(tiny_model),
                  args=["--model-dir", str(tiny_model.parent)])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def frontend(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    logs = tmp_path_factory.mktemp("logs")
    proc = Frontend(engine.endpoint, logs / "frontend.log", workers=2)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def model_id(tiny_model: Path) -> str:
    return str(tiny_model)
