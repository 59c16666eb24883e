"""Shared pieces of the agent-CLI tests (Claude Code, Codex CLI, opencode) against the real stack.

The CLIs are npm packages pinned in tests/clients/agents/package-lock.json and installed there by
`npm ci` (once; reused while node_modules matches the lockfile). Their native binaries come from
optional per-platform dependencies; Claude Code's postinstall copies its binary into place, so
the install runs package scripts (`allowScripts` in package.json approves exactly the two that
have one). Every CLI runs unmodified, with HOME (and its config dirs) in a temporary directory,
stdin closed, in its own process group that is killed when the run ends, so no agent process
outlives its test.

Random-weight models never end a turn, and an agent waits for the end of its turn: the tests
serve a model built with `ends_after` (model_builders/ending.py), whose every reply is the same
few words then `<|im_end|>`, whatever the prompt. Its context window is the default 32768: Claude
Code asks for `max_tokens: 128000` on a ~23k-token prompt, and the engine's default
`--max-tokens-overflow clamp` lowers that to what the window has left, as it would for a real model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

AGENTS_DIR = Path(__file__).parent / "agents"
BIN = AGENTS_DIR / "node_modules" / ".bin"


def pinned_version(package: str) -> str:
    """The version of npm `package` that package.json pins (each test checks the CLI it runs is that one)."""
    return json.loads((AGENTS_DIR / "package.json").read_text())["dependencies"][package]
NODE = shutil.which("node")
NPM = shutil.which("npm")

needs_node = pytest.mark.skipif(NODE is None or NPM is None,
                                reason="node and npm are needed to install the agent CLIs (tests/clients/agents)")

# Every reply of the served model is ENDS_AFTER word tokens, then the end of the turn.
ENDS_AFTER = 4
# One CLI run: the first Claude Code turn prefills ~23k tokens (about 8 s on 2 idle cores).
RUN_TIMEOUT = 420


def _installed_matches_lockfile() -> bool:
    """Whether node_modules holds exactly what package-lock.json pins (npm's hidden lockfile says so)."""
    hidden = AGENTS_DIR / "node_modules" / ".package-lock.json"
    if not hidden.exists():
        return False
    pinned = json.loads((AGENTS_DIR / "package-lock.json").read_text())["packages"]
    installed = json.loads(hidden.read_text())["packages"]
    # Optional platform packages of other OS/CPUs are in the lockfile but never installed.
    return all(installed.get(k) == v for k, v in pinned.items() if k and k in installed) and \
        all(k in installed for k, v in pinned.items() if k and not v.get("optional"))


def install_agent_clis() -> Path:
    """tests/clients/agents with its node_modules installed from the committed lockfile; returns node_modules/.bin."""
    if not _installed_matches_lockfile() or not all((BIN / name).exists() for name in ("claude", "codex", "opencode")):
        # No --ignore-scripts: Claude Code's postinstall puts its native binary in place.
        done = subprocess.run([NPM, "ci", "--no-audit", "--no-fund", "--prefer-offline"], cwd=AGENTS_DIR,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.fail(f"npm ci failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return BIN


def agent_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of an agent CLI: this process's, minus LD_PRELOAD, with HOME and XDG dirs under `home`."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith(
        ("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE_", "XDG_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"),
               NO_COLOR="1", TERM="dumb")
    env.update(extra)
    return env


@dataclass
class Run:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"{' '.join(self.argv)} exited {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def run_cli(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = RUN_TIMEOUT) -> Run:
    """Runs one CLI command in its own process group, stdin closed; the whole group is killed afterwards."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not finish in {timeout} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    finally:
        _kill_group(proc.pid)  # helpers it left behind (codex's sandbox, opencode's server)
    return Run(argv, proc.returncode, stdout, stderr)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def build_ending_vlm(out_dir: Path) -> Path:
    """The tiny random-weight Qwen2-VL, ending every reply after ENDS_AFTER words (model_builders.vlm)."""
    from model_builders.vlm import build_vlm

    return build_vlm(out_dir, size="tiny", seed=0, ends_after=ENDS_AFTER)


def claude_project_dir(home: Path, cwd: Path) -> Path:
    """Where Claude Code keeps the session transcripts of `cwd`: ~/.claude/projects/<cwd, non-alphanumerics as '-'>."""
    return home / ".claude" / "projects" / re.sub(r"[^a-zA-Z0-9]", "-", str(cwd.resolve()))


def engine_cached_tokens(engine_log: str) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) of every request the engine accepted, in order (from its INFO log)."""
    return [(int(m.group(1)), int(m.group(2)))
            for m in re.finditer(r"accepted model=\S+ prompt_tokens=(\d+) cached_tokens=(\d+)", engine_log)]


# -- fixtures (imported by the test modules) ----------------------------------------------------
@pytest.fixture(scope="session")
def agent_bin() -> Path:
    return install_agent_clis()


@pytest.fixture(scope="session")
def ending_model(tiny_model: Path) -> Path:
    """The tiny text model, ending every reply after ENDS_AFTER words (default 32768-token window)."""
    from model_builders.text import build_model

    return build_model(tiny_model.parent / f"tiny-ends-after-{ENDS_AFTER}", size="tiny", seed=0,
                       ends_after=ENDS_AFTER)


def serve(ipc_dir: Path, logs: Path, model: Path, name: str):
    """A dedicated engined (serving `model`, `--model-fallback loaded`) + 1-worker front-end, as a context manager.

    `--model-fallback loaded`: the CLIs name their own hard-coded models (`claude-opus-…`,
    `gpt-…`), which the engine serves with the loaded model instead of a 404.
    """
    from tests.helpers import running_stack

    return running_stack(f"ipc://{ipc_dir}/{name}.sock", logs, model=str(model),
                         engine_args=["--model-fallback", "loaded"], workers=1)


def reply_of(frontend, model: Path) -> str:
    """What the served ending model answers (any prompt gives the same words)."""
    import httpx

    done = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60,
                      json={"model": str(model), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50})
    done.raise_for_status()
    text = done.json()["choices"][0]["message"]["content"].strip()
    assert text and len(text.split()) == ENDS_AFTER, text
    return text
