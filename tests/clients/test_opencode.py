"""opencode (npm `opencode-ai`, pinned in tests/clients/agents/package-lock.json) against the real stack.

`opencode run` runs unmodified over the three APIs, one provider each in its config file:
Chat Completions (`@ai-sdk/openai-compatible`), Responses (`@ai-sdk/openai`) and Messages
(`@ai-sdk/anthropic`). The three AI SDK providers are bundled in opencode's binary (nothing is
fetched for them); at its first start opencode itself `npm install`s `@opencode-ai/plugin` into its
config dir (from the npm registry), so the module shares one HOME between the runs. The model list
is not fetched from models.dev (OPENCODE_DISABLE_MODELS_FETCH).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clients.agent_stack import (
    agent_bin,  # noqa: F401 (fixture)
    agent_env,
    ending_model,  # noqa: F401 (fixture)
    needs_node,
    pinned_version,
    reply_of,
    run_cli,
    serve,
)
from tests.helpers import Engine, Frontend

pytestmark = needs_node

OPENCODE_VERSION = pinned_version("opencode-ai")
PROVIDERS = {"chat": "@ai-sdk/openai-compatible", "responses": "@ai-sdk/openai", "messages": "@ai-sdk/anthropic"}
ENDPOINTS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


@pytest.fixture(scope="module")
def opencode_stack(ipc_dir: Path, ending_model: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
                   ) -> Iterator[tuple[Engine, Frontend]]:
    with serve(ipc_dir, tmp_path_factory.mktemp("opencode-logs"), ending_model, "opencode") as stack:
        yield stack


@pytest.fixture(scope="module")
def opencode_home(opencode_stack: tuple[Engine, Frontend], ending_model: Path,  # noqa: F811
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, frontend = opencode_stack
    home = tmp_path_factory.mktemp("opencode-home")
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            f"mlxe-{api}": {"npm": package, "name": f"mlx-engined {api}",
                            "options": {"baseURL": f"{frontend.base_url}/v1", "apiKey": "dummy-key"},
                            "models": {"tiny": {"name": "tiny"}}}
            for api, package in PROVIDERS.items()},
    }
    (home / "opencode.json").write_text(json.dumps(config, indent=2))
    return home


@pytest.mark.parametrize("api", list(PROVIDERS))
def test_opencode_run_over_each_api(agent_bin: Path, opencode_stack: tuple[Engine, Frontend],  # noqa: F811
                                    opencode_home: Path, ending_model: Path, tmp_path: Path, api: str) -> None:  # noqa: F811
    engine, frontend = opencode_stack
    expected = reply_of(frontend, ending_model)
    env = agent_env(opencode_home, OPENCODE_CONFIG=str(opencode_home / "opencode.json"),
                    OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_AUTOUPDATE="1")
    opencode = str(agent_bin / "opencode")
    assert run_cli([opencode, "--version"], tmp_path, env).stdout.strip() == OPENCODE_VERSION
    done = run_cli([opencode, "run", "-m", f"mlxe-{api}/tiny", "Say hello"], tmp_path, env)
    assert done.returncode == 0, done.describe()
    assert expected in done.stdout, done.describe()
    # The provider spoke its own API (the front-end's access log names the route of every request).
    assert f"route={ENDPOINTS[api]} path={ENDPOINTS[api]} status=200" in frontend.log(), frontend.log()[-3000:]
