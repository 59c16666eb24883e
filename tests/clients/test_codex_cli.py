"""Codex CLI (npm `@openai/codex`, pinned in tests/clients/agents/package-lock.json) against the real stack.

`codex exec` runs unmodified with a custom model provider (`wire_api = "responses"`, base_url the
front-end's /v1) in a temporary CODEX_HOME, default model and default features: Codex 0.169's
default model (`gpt-6.1-sol`) uses "Responses lite" — its tools arrive in an `additional_tools`
input item (`namespace` tools holding `function` and `custom` grammar tools), not in `tools`.
The engine's `--model-fallback loaded` serves the unknown model name.

Then `codex exec resume --last` continues the same conversation: Codex sends the whole
conversation again (`store: false`), so the engine must find its prefix in the prompt cache;
the test reads `cached_input_tokens` from Codex's own `turn.completed` event (`--json`) and the
engine's `accepted … cached_tokens=N` log line.
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
    engine_cached_tokens,
    needs_node,
    pinned_version,
    reply_of,
    run_cli,
    serve,
)
from tests.helpers import Engine, Frontend

pytestmark = needs_node

CODEX_VERSION = pinned_version("@openai/codex")


@pytest.fixture(scope="module")
def codex_stack(ipc_dir: Path, ending_model: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
                ) -> Iterator[tuple[Engine, Frontend]]:
    with serve(ipc_dir, tmp_path_factory.mktemp("codex-logs"), ending_model, "codex") as stack:
        yield stack


def codex_home(home: Path, frontend: Frontend) -> Path:
    codex = home / "codex"
    codex.mkdir(parents=True)
    (codex / "config.toml").write_text(
        'model_provider = "mlx-engined"\n'
        "\n"
        "[model_providers.mlx-engined]\n"
        'name = "mlx-engined"\n'
        f'base_url = "{frontend.base_url}/v1"\n'
        'wire_api = "responses"\n')
    return codex


def events(stdout: str) -> list[dict]:
    """`codex exec --json` prints one JSON event per line."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def agent_text(evts: list[dict]) -> str:
    return "".join(e["item"].get("text", "") for e in evts
                   if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message")


def codex_workspace(tmp_path: Path, frontend: Frontend) -> tuple[Path, dict[str, str]]:
    """A working directory and Codex's environment (HOME and CODEX_HOME under `tmp_path`)."""
    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "home"
    return work, agent_env(home, CODEX_HOME=str(codex_home(home, frontend)))


def turn_usage(evts: list[dict]) -> dict:
    (usage,) = [e["usage"] for e in evts if e.get("type") == "turn.completed"]
    return usage


def test_codex_exec_then_resume_reuses_the_cached_prefix(agent_bin: Path, codex_stack: tuple[Engine, Frontend],  # noqa: F811
                                                         ending_model: Path, tmp_path: Path) -> None:  # noqa: F811
    engine, frontend = codex_stack
    expected = reply_of(frontend, ending_model)
    work, env = codex_workspace(tmp_path, frontend)
    codex = str(agent_bin / "codex")
    assert CODEX_VERSION in run_cli([codex, "--version"], work, env).stdout

    first = run_cli([codex, "exec", "--skip-git-repo-check", "--json", "Say hello"], work, env)
    assert first.returncode == 0, first.describe()
    assert expected in agent_text(events(first.stdout)), first.describe()
    before = len(engine_cached_tokens(engine.log()))

    second = run_cli([codex, "exec", "--skip-git-repo-check", "--json", "resume", "--last", "Say it again"], work, env)
    assert second.returncode == 0, second.describe()
    evts = events(second.stdout)
    assert expected in agent_text(evts), second.describe()
    # The resumed turn resends the first turn: its prefix comes from the engine's prompt cache.
    assert turn_usage(evts)["cached_input_tokens"] > 0, second.describe()
    resumed = engine_cached_tokens(engine.log())[before:]
    assert resumed and resumed[0][1] > 0, engine.log()


def test_codex_exec_with_custom_and_hosted_tools(agent_bin: Path, codex_stack: tuple[Engine, Frontend],  # noqa: F811
                                                 ending_model: Path, tmp_path: Path) -> None:  # noqa: F811
    """`-m gpt-5.5`: top-level tools with a `custom` apply_patch (Lark grammar), `tool_search` and `web_search`."""
    engine, frontend = codex_stack
    expected = reply_of(frontend, ending_model)
    work, env = codex_workspace(tmp_path, frontend)
    done = run_cli([str(agent_bin / "codex"), "exec", "-m", "gpt-5.5", "--skip-git-repo-check", "--json", "Say hello"],
                   work, env)
    assert done.returncode == 0, done.describe()
    assert expected in agent_text(events(done.stdout)), done.describe()
    # The hosted tools were left out of the prompt, and said so (the route also sets X-Ignored-Tools).
    assert "tools the engine cannot run were left out: tool_search, web_search" in frontend.log()
