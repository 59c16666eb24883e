"""The playground in Debian's chromium (Playwright for Python, `executable_path`) against a live stack.

Playwright's own browser download is never used (`playwright install` is not needed): the tests
drive the system's chromium and are skipped, with the reason, where none is installed. One engine
serves a tiny random-weight text model (loaded at start) and a tiny Qwen2-VL next to it; one
gunicorn front-end serves the page and the API.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Engine, Frontend

CHROMIUM_ENV = "PLAYGROUND_CHROMIUM"  # a chromium binary elsewhere than the usual places
TEXT = "tiny-qwen2"
VLM = "tiny-qwen2-vl"


def chromium_binary() -> str | None:
    candidates = [os.environ.get(CHROMIUM_ENV), shutil.which("chromium"), shutil.which("chromium-browser"),
                  "/usr/bin/chromium", "/usr/lib/chromium/chromium"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


# Module scope, not session: Playwright's sync API runs an asyncio loop in this thread while it is
# started, and every later test calling asyncio.run() would fail ("cannot be called from a running
# event loop"). It is stopped when the browser module ends.
@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    binary = chromium_binary()
    if binary is None:
        pytest.skip(f"no chromium binary (apt-get install chromium, or set {CHROMIUM_ENV})")
    # The OpenBLAS preload the engine wants (LD_PRELOAD) breaks Playwright's node driver (pthread_create:
    # Invalid argument) and chromium's GPU process: both start without it.
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        manager = sync_playwright().start()
        try:
            browser = manager.chromium.launch(executable_path=binary, args=["--no-sandbox"])
        except Exception as exc:  # a binary that cannot start here (missing libraries, no /dev/shm…)
            manager.stop()
            pytest.skip(f"chromium at {binary} does not start: {exc}")
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        yield browser
    finally:
        try:
            browser.close()
        finally:
            manager.stop()
            _forget_a_leftover_running_loop()


def _forget_a_leftover_running_loop() -> None:
    """Playwright's sync API marks its loop as this thread's running loop while it is started; a stop
    that did not finish (a crashed browser) would leave it marked and fail every later asyncio.run()."""
    import asyncio

    if asyncio._get_running_loop() is not None:
        asyncio._set_running_loop(None)


@pytest.fixture(scope="module")
def browser_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_builders.text import build_model
    from model_builders.vlm import build_vlm

    root = tmp_path_factory.mktemp("browser-models")
    build_model(root / TEXT, size="tiny", seed=0)
    build_vlm(root / VLM, seed=1)
    return root


@pytest.fixture(scope="module")
def browser_stack(browser_models: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[Engine, Frontend]]:
    logs = tmp_path_factory.mktemp("browser-logs")
    engine = Engine(f"ipc://{ipc_dir}/browser.sock", logs / "engined.log", model=str(browser_models / TEXT),
                    args=["--model-dir", str(browser_models), "--served-model-name", TEXT])
    frontend = Frontend(engine.endpoint, logs / "frontend.log", workers=1)
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        yield engine, frontend
    finally:
        frontend.stop()
        engine.stop()


@dataclass
class Session:
    """One open playground tab and everything it asked for, said and broke."""

    page: Any
    base_url: str
    requests: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def chat_bodies(self) -> list[dict[str, Any]]:
        return [r.post_data_json for r in self.requests if r.url.endswith("/v1/chat/completions")]


def open_playground(browser: Any, base_url: str, *, color_scheme: str = "light", path: str = "/") -> Session:
    context = browser.new_context(viewport={"width": 1440, "height": 900}, color_scheme=color_scheme)
    page = context.new_page()
    session = Session(page, base_url)
    page.on("request", lambda request: session.requests.append(request))
    page.on("pageerror", lambda exc: session.errors.append(f"pageerror: {exc}"))
    page.on("console", lambda msg: session.errors.append(f"console: {msg.text}") if msg.type == "error" else None)
    page.goto(base_url + path)
    return session


def wait_for_models(page: Any) -> None:
    page.wait_for_function("() => document.querySelectorAll('#model option[value]:not([value=\"\"])').length > 0")
