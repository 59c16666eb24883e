"""`--models-config` parsing, without processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_daemon.models.names import ModelNames, ModelsConfigError, load_models_config
from engine_daemon.models.store import ModelNotFound

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


def fake_model_dir(path: Path) -> Path:
    """Enough of a model directory for `is_mlx_model_dir` (nothing here loads it)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_glob_aliases_reach_their_model_under_its_name(tmp_path: Path) -> None:
    qwen, other = fake_model_dir(tmp_path / "qwen"), fake_model_dir(tmp_path / "other")
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n  - alias: 'claude-*'\n    path: {qwen}\n  - alias: 'gpt-?'\n    path: {other}\n"
                      f"  - alias: fast\n    path: {other}\n    temperature: 0\n")
    names = ModelNames.from_options(models_config=config, model=str(qwen), served_model_name="qwen")
    assert names.names() == ["qwen", "fast"]  # patterns are not names: /v1/models lists names only
    assert [m["id"] for m in names.catalogue()] == ["qwen", "fast"]
    for name in ("claude-opus-4-1-20250805", "claude-"):
        ref = names.resolve(name, default_model=str(qwen), roots=[], allow_download=False)
        assert (ref.id, ref.path) == ("qwen", qwen.resolve())  # the served name: same ref, no second load
    ref = names.resolve("gpt-5", default_model=None, roots=[], allow_download=False)
    assert (ref.id, ref.path) == ("fast", other.resolve())  # the directory's first name
    with pytest.raises(ModelNotFound):
        names.resolve("gpt-55", default_model=None, roots=[], allow_download=False)  # '?' is one character


def test_a_pattern_carries_no_settings(tmp_path: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - alias: 'claude-*'\n    repo: x/y\n    temperature: 0\n")
    with pytest.raises(ModelsConfigError, match="a pattern only says where its names go"):
        load_models_config(config)
