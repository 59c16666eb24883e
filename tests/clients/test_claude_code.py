"""Claude Code (npm `@anthropic-ai/claude-code`, pinned in tests/clients/agents/package-lock.json) on the real stack.

`claude -p` runs unmodified over the Messages API (`POST /v1/messages?beta=true` with its
`anthropic-beta` headers, `system`-role messages inside `messages`, adaptive thinking,
`context_management`, `output_config`, max_tokens 128000, a ~23k-token first prompt) with
ANTHROPIC_BASE_URL pointing at the front-end and a dummy key. No ANTHROPIC_MODEL: the CLI asks
for its own default model (`claude-opus-…`) and the engine's `--model-fallback loaded` serves it.

The image/PDF test cannot rely on a random model deciding to call Read, so it resumes a session
transcript written beforehand (the JSONL format Claude Code writes to
~/.claude/projects/<cwd>/<session id>.jsonl): a user turn, an assistant turn with two Read
tool_use blocks, and the tool results exactly as Claude Code 2.1's Read tool builds them (an
`image` block for a PNG; a `text` block + a base64 `document` block for a PDF). `claude -p
--resume <id>` then sends them back in the next request, to the tiny VLM.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clients.agent_stack import (
    agent_bin,  # noqa: F401 (fixture)
    agent_env,
    build_ending_vlm,
    claude_project_dir,
    ending_model,  # noqa: F401 (fixture)
    engine_cached_tokens,
    needs_node,
    pinned_version,
    reply_of,
    run_cli,
    serve,
)
from tests.helpers import Engine, Frontend, pdf, png

pytestmark = needs_node

CLAUDE_VERSION = pinned_version("@anthropic-ai/claude-code")

# A real one-page PDF (what the Read tool would base64 as is).
PDF = pdf("Quarterly report: revenue up")


def claude_env(home: Path, frontend: Frontend, **extra: str) -> dict[str, str]:
    return agent_env(home, ANTHROPIC_BASE_URL=frontend.base_url, ANTHROPIC_API_KEY="dummy-key",
                     # Loopback only: no telemetry, error reporting, update or feature-flag calls.
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1", **extra)


@pytest.fixture(scope="module")
def text_stack(ipc_dir: Path, ending_model: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
               ) -> Iterator[tuple[Engine, Frontend]]:
    with serve(ipc_dir, tmp_path_factory.mktemp("claude-logs"), ending_model, "claude") as stack:
        yield stack


def test_claude_print_mode_answers_with_the_served_model(agent_bin: Path, text_stack: tuple[Engine, Frontend],  # noqa: F811
                                                         ending_model: Path, tmp_path: Path) -> None:  # noqa: F811
    engine, frontend = text_stack
    expected = reply_of(frontend, ending_model)
    work = tmp_path / "work"
    work.mkdir()
    assert run_cli([str(agent_bin / "claude"), "--version"], work, agent_env(tmp_path / "home")).stdout.startswith(
        CLAUDE_VERSION)
    done = run_cli([str(agent_bin / "claude"), "-p", "Say hello"], work, claude_env(tmp_path / "home", frontend))
    assert done.returncode == 0, done.describe()
    assert expected in done.stdout, done.describe()
    # Its default model is not served here: the fallback ran it (logged once per unknown name).
    assert "is not known: served by" in engine.log()
    accepted = engine_cached_tokens(engine.log())
    assert accepted and accepted[-1][0] > 10_000  # the agent's real system prompt and tools reached the model
    # It asks for max_tokens=128000 whatever the model: the default --max-tokens-overflow clamp fits it in the window.
    assert "max_tokens 128000 clamped to" in engine.log()


def write_read_session(home: Path, work: Path) -> str:
    """A Claude Code transcript ending in Read results for pic.png (image) and doc.pdf (document); its session id."""
    image = png(2)
    (work / "pic.png").write_bytes(image)
    (work / "doc.pdf").write_bytes(PDF)
    session = str(uuid.uuid4())
    project = claude_project_dir(home, work)
    project.mkdir(parents=True, exist_ok=True)
    common = {"isSidechain": False, "userType": "external", "cwd": str(work.resolve()), "sessionId": session,
              "version": CLAUDE_VERSION, "timestamp": "2026-01-01T00:00:00.000Z"}
    first, call, result = (str(uuid.uuid4()) for _ in range(3))
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    entries = [
        {"parentUuid": None, "type": "user", "uuid": first, **common,
         "message": {"role": "user", "content": "Read pic.png and doc.pdf"}},
        {"parentUuid": first, "type": "assistant", "uuid": call, **common,
         "message": {"id": "msg_seeded", "type": "message", "role": "assistant", "model": "claude-opus-5-5",
                     "content": [{"type": "tool_use", "id": "toolu_image", "name": "Read",
                                  "input": {"file_path": str(work / "pic.png")}},
                                 {"type": "tool_use", "id": "toolu_pdf", "name": "Read",
                                  "input": {"file_path": str(work / "doc.pdf")}}],
                     "stop_reason": "tool_use", "stop_sequence": None,
                     "usage": {"input_tokens": 1, "output_tokens": 1}}},
        {"parentUuid": call, "type": "user", "uuid": result, **common,
         "message": {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "toolu_image", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(image)}}]},
             {"type": "tool_result", "tool_use_id": "toolu_pdf", "content": [
                 {"type": "text", "text": f"PDF file read: {work / 'doc.pdf'} ({len(PDF)} B)"},
                 {"type": "document",
                  "source": {"type": "base64", "media_type": "application/pdf", "data": b64(PDF)}}]}]}},
    ]
    (project / f"{session}.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    return session


def test_claude_sends_read_results_with_an_image_and_a_pdf(agent_bin: Path, ipc_dir: Path, tiny_model: Path,  # noqa: F811
                                                           tmp_path: Path) -> None:
    vlm = build_ending_vlm(tiny_model.parent / "tiny-qwen2-vl-ends-after-4")
    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "home"
    session = write_read_session(home, work)
    with serve(ipc_dir, tmp_path, vlm, "claude-vlm") as (engine, frontend):
        expected = reply_of(frontend, vlm)
        done = run_cli([str(agent_bin / "claude"), "-p", "--resume", session, "What do they show?"], work,
                       claude_env(home, frontend))
        log = engine.log()
    assert done.returncode == 0, done.describe()
    assert expected in done.stdout, done.describe()
    assert engine_cached_tokens(log), log  # the request with the image and the PDF reached the VLM
