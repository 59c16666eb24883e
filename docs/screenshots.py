"""Takes docs/playground-light.png and docs/playground-dark.png: the playground in Debian's chromium.

A real stack (engined serving a tiny random-weight model, the gunicorn front-end) and a real
conversation typed into the page: a system prompt, a streamed answer (random weights: the words
are noise, the figures are real), then a forced tool call shown as a card. Run from the repository
root: `python docs/screenshots.py` (needs chromium and the test extra: playwright).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.browser.conftest import TEXT, chromium_binary, open_playground, wait_for_models  # noqa: E402
from tests.helpers import running_stack  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}]


def converse(page) -> None:  # noqa: ANN001 (a Playwright page)
    page.fill("#system", "You are a concise assistant running on a laptop.")
    page.fill("#settings [name=temperature]", "0.7")
    page.fill("#settings [name=seed]", "3")
    page.fill("#settings [name=max_tokens]", "48")

    def ask(text: str, count: int) -> None:
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")
        page.wait_for_function(
            "(n) => document.querySelectorAll('.msg.assistant').length >= n && "
            "!document.querySelector('#send').disabled", arg=count, timeout=120_000)

    ask("Write a haiku about fast local inference.", 1)
    page.click("#tools-section summary")
    page.fill("#tools", json.dumps(TOOLS, indent=1))
    page.select_option("#tool_choice", "required")
    page.uncheck("#settings [name=parallel_tool_calls]")
    ask("What is the weather in Paris?", 2)
    page.fill("#prompt", "Thanks! And in Lyon?")
    page.wait_for_function("() => +document.querySelector('#stats').dataset.polls >= 3")


def main() -> int:
    from playwright.sync_api import sync_playwright

    from model_builders.text import build_model

    binary = chromium_binary()
    if binary is None:
        print("no chromium binary: apt-get install chromium", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="mlxe-shots-"))
    model = build_model(work / "models" / TEXT, size="tiny", seed=0)
    (work / "logs").mkdir()
    with running_stack(f"ipc://{work}/e.sock", work / "logs", model=str(model),
                       engine_args=["--served-model-name", TEXT]) as (_, frontend):
        preload = os.environ.pop("LD_PRELOAD", None)  # see tests/browser/conftest.py: chromium
        with sync_playwright() as manager:
            browser = manager.chromium.launch(executable_path=binary, args=["--no-sandbox"])
            if preload is not None:
                os.environ["LD_PRELOAD"] = preload
            for scheme in ("light", "dark"):
                session = open_playground(browser, frontend.base_url, color_scheme=scheme)
                wait_for_models(session.page)
                converse(session.page)
                out = ROOT / "docs" / f"playground-{scheme}.png"
                session.page.screenshot(path=str(out))
                print(f"wrote {out} ({out.stat().st_size} bytes)")
                session.page.context.close()
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
