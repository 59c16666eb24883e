"""`--models-config` parsing, without processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_daemon.models.names import ModelNames, ModelsConfigError, load_models_config

CUSTOM_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("models:\n  - alias: a\n", "exactly one of 'path'"),
    ("models:\n  - alias: a\n    repo: x/y\n    temprature: 0\n", "unknown keys ['temprature']"),
    ("models:\n  - alias: a\n    repo: x/y\n  - alias: a\n    repo: x/z\n", "given twice: a"),
    ("models:\n  - alias: a\n    repo: x/y\n    tool_parser: nope\n", "no tool parser 'nope'"),
    ("models:\n  - alias: a\n    repo: x/y\n    context_length: -4\n", "'context_length' must be a positive"),
    ("models:\n  - alias: a\n    repo: x/y\n    chat_template: missing.jinja\n", "cannot read chat template"),
    ("models: [unclosed\n", "not valid YAML"),
])
def test_invalid_models_config_is_refused(tmp_path: Path, yaml_text: str, message: str) -> None:
    config = tmp_path / "models.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ModelsConfigError) as refused:
        load_models_config(config)
    assert message in str(refused.value)


def test_models_config_forms(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(CUSTOM_TEMPLATE)
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  fast:\n    path: m\n    defaults: {top_p: 0.5}\n    top_k: 4\n"
                      "    chat_template: t.jinja\n    context_overflow: truncate\n")
    (entry,) = load_models_config(config)
    assert entry.name == "fast" and entry.source == str(tmp_path.resolve() / "m")
    assert dict(entry.profile.sampling) == {"top_p": 0.5, "top_k": 4}
    assert entry.profile.chat_template == CUSTOM_TEMPLATE and entry.profile.context_overflow == "truncate"
    with pytest.raises(ModelsConfigError, match="needs --model"):
        ModelNames.from_options(served_model_name="x")
    with pytest.raises(ModelsConfigError, match="context_overflow must be one of"):
        ModelNames.from_options(context_overflow="drop")
