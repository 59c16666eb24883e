"""A random-weight model built with --ends-after ends its turns over every API, as agents need."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import pytest

from model_builders.text import build_model
from tests.helpers import Frontend, client_for


@pytest.fixture(scope="module")
def ending_model(tiny_model: Path) -> str:
    return str(build_model(tiny_model.parent / "tiny-ends-after-4", size="tiny", seed=0, ends_after=4))


def test_chat_responses_and_messages_end_their_turn(frontend: Frontend, ending_model: str) -> None:
    chat = client_for(frontend).chat.completions.create(
        model=ending_model, messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 4
    response = client_for(frontend).responses.create(model=ending_model, input="hi", max_output_tokens=100)
    assert response.status == "completed" and response.output_text == chat.choices[0].message.content
    message = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused").messages.create(
        model=ending_model, max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    assert message.stop_reason == "end_turn"
    assert httpx.get(f"{frontend.base_url}/health").json()["status"] == "healthy"
