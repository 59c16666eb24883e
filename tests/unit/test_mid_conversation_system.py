"""System turns inside `messages` (Claude Code's mid-conversation system): rendered, or folded where a
template takes a system turn only at the start (`fold_late_system_turns`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm import load

from engine_daemon.models.loaded import LoadedModel
from engine_daemon.models.store import ModelRef
from engine_daemon.request.prompt import build_prompt, fold_late_system_turns
from http_frontend.anthropic.request import chat_messages

STRICT = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
          "{{ raise_exception('System role only at the start') }}{% endif %}"
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_anthropic_system_turns_inside_messages_become_chat_system_turns() -> None:
    converted = chat_messages({"system": "top", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "agents: a, b"}, {"type": "text", "text": "skills"}]},
        {"role": "user", "content": "go"}]})
    assert [m["role"] for m in converted] == ["system", "user", "system", "user"]
    assert converted[2]["content"] == "agents: a, b\nskills"


def test_late_system_turns_fold_into_the_next_user_turn() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "system", "content": "late"},
                {"role": "user", "content": "u2"}]
    assert fold_late_system_turns(messages) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "late\n\nu2"}]
    assert fold_late_system_turns(messages[:3]) is None


@pytest.fixture(scope="module")
def strict_model(tiny_model: Path) -> LoadedModel:
    model, tokenizer = load(str(tiny_model))
    tokenizer._tokenizer.chat_template = STRICT
    return LoadedModel(ref=ModelRef(id="strict", path=tiny_model), model=model, tokenizer=tokenizer,
                       context_window=32768)


def test_a_template_without_late_system_turns_gets_them_folded(strict_model: LoadedModel) -> None:
    late = [{"role": "user", "content": "u1"}, {"role": "system", "content": "late"},
            {"role": "user", "content": "u2"}]
    folded = [{"role": "user", "content": "u1"}, {"role": "user", "content": "late\n\nu2"}]
    assert build_prompt(strict_model, {"messages": late}) == build_prompt(strict_model, {"messages": folded})
