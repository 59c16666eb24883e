"""`--model-fallback loaded`: agents' hard-coded model names reach the loaded model (real engined + gunicorn).

Claude Code asks for `claude-sonnet-…`, Codex for `gpt-5-codex`: without the fallback those are
404 `model_not_found` and the agent stops on its first request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.helpers import Engine, Frontend, client_for, running_stack

SERVED = "local-model"


@pytest.fixture(scope="module")
def fallback_stack(tiny_model: Path, ipc_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Frontend]]:
    with running_stack(f"ipc://{ipc_dir}/fallback.sock", tmp_path_factory.mktemp("fallback"), model=str(tiny_model),
                       engine_args=["--served-model-name", SERVED],
                       env={"MLX_ENGINE_MODEL_FALLBACK": "loaded"}) as stack:
        yield stack


def loads(frontend: Frontend) -> int:
    return httpx.get(f"{frontend.base_url}/health", timeout=10).json()["engine"]["model_loads"]


def test_unknown_names_reach_the_loaded_model(fallback_stack: tuple[Engine, Frontend]) -> None:
    engine, frontend = fallback_stack
    before = loads(frontend)
    openai_client = client_for(frontend)
    for name in ("gpt-5-codex", "claude-sonnet-4-5-20250929"):
        reply = openai_client.chat.completions.create(model=name, max_tokens=2,
                                                      messages=[{"role": "user", "content": "hi"}])
        assert reply.model == SERVED  # the answer names the model that ran
    message = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0).messages.create(
        model="claude-opus-4-1-20250805", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert message.model == SERVED and message.usage.output_tokens == 2
    assert loads(frontend) == before  # no load: the loaded model served every name
    assert "'gpt-5-codex' is not known: served by local-model (--model-fallback loaded)" in engine.log()


def test_models_lists_the_served_names_and_bad_names_are_still_refused(fallback_stack: tuple[Engine, Frontend]) -> None:
    _, frontend = fallback_stack
    listed = [m["id"] for m in httpx.get(f"{frontend.base_url}/v1/models", timeout=10).json()["data"]]
    assert listed[0] == SERVED and "claude-sonnet-4-5-20250929" not in listed
    refused = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=30, json={
        "model": "../../etc", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_model_name"


def test_retrieving_a_name_the_fallback_serves_finds_it(fallback_stack: tuple[Engine, Frontend]) -> None:
    """Red team: OpenAI clients and LiteLLM retrieve a model before using it; `gpt-5-codex` was a 404 there
    while a chat naming it was served. Retrieval now says what a chat would do, under the name asked for."""
    _, frontend = fallback_stack
    served = httpx.get(f"{frontend.base_url}/v1/models/{SERVED}", timeout=30).json()
    for name in ("gpt-5-codex", "org/agent-model"):
        model = client_for(frontend).models.retrieve(name)
        assert (model.id, model.object, model.loaded) == (name, "model", True)
        assert model.context_window == served["context_window"] and model.type == "text"
    info = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0).models.retrieve(
        "claude-opus-4-1-20250805")
    assert info.id == "claude-opus-4-1-20250805" and info.type == "model"
    head = httpx.head(f"{frontend.base_url}/v1/models/gpt-5-codex", timeout=30)
    assert head.status_code == 200
    refused = httpx.get(f"{frontend.base_url}/v1/models/%2E%2E%2F%2E%2E%2Fetc", timeout=30)  # `../../etc`: no model
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text


def test_count_tokens_counts_with_the_model_that_would_answer(fallback_stack: tuple[Engine, Frontend]) -> None:
    """Red team: Claude Code's count_tokens named `claude-…` and got a 400 the fallback never gave its messages."""
    _, frontend = fallback_stack
    client = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    name = "claude-sonnet-4-5-20250929"
    counted = client.messages.count_tokens(model=name, messages=messages)
    served = client.messages.create(model=name, max_tokens=1, messages=messages)
    usage = served.usage  # Anthropic's input_tokens leave out what the prompt cache read
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0
    unknown_spelling = httpx.post(f"{frontend.base_url}/v1/messages/count_tokens", timeout=30, json={
        "model": "../../etc", "messages": messages})
    assert unknown_spelling.status_code == 400, unknown_spelling.text
