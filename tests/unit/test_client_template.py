"""A client's chat template (--allow-request-chat-template) renders like the model's own, within its budgets."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm import load

from engine_daemon.errors import RequestError
from engine_daemon.request import client_template, template_kwargs
from engine_daemon.request.prompt import build_prompt


@pytest.fixture
def allowed() -> None:
    template_kwargs.configure(True)
    yield
    template_kwargs.configure(False)


@pytest.fixture(scope="module")
def loaded(tiny_model: Path):
    from engine_daemon.models.loaded import LoadedModel
    from engine_daemon.models.store import ModelRef

    model, tokenizer = load(str(tiny_model))
    return LoadedModel(ref=ModelRef(id="tiny", path=tiny_model), model=model, tokenizer=tokenizer,
                       context_window=32768)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_the_models_own_template_sent_by_the_client_gives_the_same_tokens(loaded, allowed) -> None:
    own = build_prompt(loaded, {"messages": MESSAGES})
    sent = build_prompt(loaded, {"messages": MESSAGES,
                                 "chat_template_kwargs": {"chat_template": loaded.tokenizer.chat_template}})
    assert sent == own


def test_without_the_flag_a_client_template_is_refused(loaded) -> None:
    with pytest.raises(RequestError) as caught:
        build_prompt(loaded, {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    assert caught.value.status == 400 and "chat_template" in str(caught.value)


@pytest.mark.parametrize("template,code", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "chat_template_budget_exceeded"),
    ("{{ 'x' * 400000000 }}", "chat_template_budget_exceeded"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "chat_template_budget_exceeded"),
    ("{{ ''.__class__.__mro__ }}", "invalid_chat_template"),
    ("{% for %}", "invalid_chat_template"),
])
def test_budgets_and_the_sandbox_stop_hostile_templates(template: str, code: str) -> None:
    with pytest.raises(RequestError) as caught:
        client_template.render(template, {"messages": MESSAGES})
    assert caught.value.status == 400 and caught.value.code == code
