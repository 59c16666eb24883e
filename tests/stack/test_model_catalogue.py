"""The model catalogue, model names and chat templates through real processes (openai SDK -> gunicorn -> engined).

One engine serves a dedicated HF cache (a text model, a tiny Qwen2-VL, and a PyTorch-only
repo that must not be listed), a `--model-dir` root, a `--models-config` of aliases with
their own settings, `--served-model-name` for its `--model`, and a `--chat-template-file`
that every model uses unless its entry says otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from model_builders.hf_cache import place_in_hf_cache
from model_builders.text import derive_model
from model_builders.tokenizer import thinking_chat_template
from tests.helpers import Frontend, client_for, running_stack

TEXT_REPO, VLM_REPO, NOT_MLX = "mlx-community/tiny-text", "mlx-community/tiny-vlm", "someone/pytorch-only"
SERVED = "tiny-served"
GLOBAL_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")
CUSTOM_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def variant(src: Path, dst: Path, config: dict | None = None, drop_template: bool = False) -> Path:
    """A copy of a built model (weights hard-linked) with config.json keys changed or its chat template removed."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.startswith("."):
            target = dst / path.name
            target.unlink(missing_ok=True)
            os.link(path, target)
    if config:
        (dst / "config.json").unlink()
        (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    if drop_template:
        tokenizer_config = json.loads((src / "tokenizer_config.json").read_text())
        tokenizer_config.pop("chat_template", None)
        (dst / "tokenizer_config.json").unlink()
        (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return dst


@pytest.fixture(scope="module")
def layout(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from model_builders.vlm import build_vlm

    base = tmp_path_factory.mktemp("catalogue")
    cache = base / "hub"
    place_in_hf_cache(variant(tiny_model, base / "src" / "text", {"max_position_embeddings": 4096}), TEXT_REPO, cache)
    place_in_hf_cache(build_vlm(base / "src" / "vlm"), VLM_REPO, cache)
    not_mlx = base / "src" / "not-mlx"
    not_mlx.mkdir()
    (not_mlx / "config.json").write_text(json.dumps({"model_type": "bert", "max_position_embeddings": 512}))
    (not_mlx / "pytorch_model.bin").write_bytes(b"\0" * 16)
    place_in_hf_cache(not_mlx, NOT_MLX, cache)

    root = base / "root"
    variant(tiny_model, root / "local-tiny")
    (root / "notes").mkdir()  # not a model: never listed
    variant(tiny_model, base / "bare", drop_template=True)
    derive_model(tiny_model, base / "thinker", thinking_chat_template())
    (base / "templates").mkdir()
    (base / "templates" / "global.jinja").write_text(GLOBAL_TEMPLATE)
    (base / "templates" / "custom.jinja").write_text(CUSTOM_TEMPLATE)
    (base / "models.yaml").write_text(f"""
models:
  - alias: small
    repo: {TEXT_REPO}
    temperature: 0
    max_tokens: 3
    context_length: 1024
  - alias: own-template
    path: {tiny_model}
    chat_template: model
  - alias: custom-template
    path: {tiny_model}
    chat_template: templates/custom.jinja
  - alias: bare
    path: bare
    chat_template: model
  - alias: thinker
    path: thinker
    chat_template: model
  - alias: thinker-plain
    path: thinker
    chat_template: model
    reasoning_parser: none
  - alias: "claude-*"
    repo: {TEXT_REPO}
""")
    return {"base": base, "cache": cache, "root": root}


@pytest.fixture(scope="module")
def served(layout: dict[str, Path], ipc_dir: Path) -> Iterator[Frontend]:
    base = layout["base"]
    with running_stack(f"ipc://{ipc_dir}/catalogue.sock", base, model=TEXT_REPO,
                       env={"HF_HUB_CACHE": str(layout["cache"]), "HF_HUB_OFFLINE": "1"},
                       engine_args=["--served-model-name", SERVED, "--models-config", str(base / "models.yaml"),
                                    "--chat-template-file", str(base / "templates" / "global.jinja"),
                                    "--model-dir", str(layout["root"])]) as (_, frontend):
        yield frontend


def health(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/health", timeout=10).json()


def chat(frontend: Frontend, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


def templated_text(frontend: Frontend, model: str) -> str:
    """What the loaded model's chat template makes of one user message (tokenize, then detokenize)."""
    tokens = httpx.post(f"{frontend.base_url}/v1/tokenize", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    return httpx.post(f"{frontend.base_url}/v1/detokenize", timeout=30, json={"tokens": tokens}).json()["prompt"]


# -- the catalogue ---------------------------------------------------------------------------------
def test_catalogue_lists_every_mlx_model_with_type_and_context_window(served: Frontend,
                                                                     layout: dict[str, Path]) -> None:
    listed = httpx.get(f"{served.base_url}/v1/models", timeout=30).json()
    models = {m["id"]: m for m in listed["data"]}
    assert listed["object"] == "list"
    assert set(models) == {SERVED, "small", "own-template", "custom-template", "bare", "thinker", "thinker-plain",
                           "local-tiny", TEXT_REPO, VLM_REPO}  # no PyTorch-only repo, no "notes" directory
    assert [m["id"] for m in listed["data"]][:2] == [SERVED, "small"]  # the operator's names first
    for model in models.values():
        assert model["object"] == "model" and model["owned_by"] and isinstance(model["created"], int)
    assert models[VLM_REPO]["type"] == "vision" and models[TEXT_REPO]["type"] == "text"
    assert models["local-tiny"]["type"] == "text" and models[SERVED]["type"] == "text"
    vlm_config = json.loads((layout["base"] / "src" / "vlm" / "config.json").read_text())
    assert models[VLM_REPO]["context_window"] == vlm_config["max_position_embeddings"]
    assert models[TEXT_REPO]["context_window"] == 4096  # the variant's max_position_embeddings
    assert models["local-tiny"]["context_window"] == 32768
    assert models["small"]["context_window"] == 1024  # its models-config context_length wins
    # The served name is loaded; its repo id is the same model (served under that name), the alias is not.
    assert models[SERVED]["loaded"] and models[TEXT_REPO]["loaded"]
    assert not models["small"]["loaded"] and not models[VLM_REPO]["loaded"]
    assert [m.id for m in client_for(served).models.list()] == [m["id"] for m in listed["data"]]


def test_get_model_by_id_accepts_ids_with_a_slash(served: Frontend) -> None:
    for path in (VLM_REPO, VLM_REPO.replace("/", "%2F")):
        r = httpx.get(f"{served.base_url}/v1/models/{path}", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == VLM_REPO and r.json()["type"] == "vision" and r.json()["object"] == "model"
    model = client_for(served).models.retrieve(TEXT_REPO)
    assert model.id == TEXT_REPO and model.context_window == 4096  # the SDK keeps extra fields
    assert httpx.get(f"{served.base_url}/models/{SERVED}", timeout=30).json()["loaded"] is True  # no /v1 prefix
    r = httpx.get(f"{served.base_url}/v1/models/{NOT_MLX}", timeout=30)
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["type"] == "invalid_request_error" and SERVED in error["message"]
    with pytest.raises(openai.NotFoundError):
        client_for(served).models.retrieve("no-such-org/no-such-model")
    # A name a glob alias sends to a model is retrieved as a chat naming it is served (not listed, not a 404).
    claude = client_for(served).models.retrieve("claude-haiku-4-5")
    assert (claude.id, claude.type, claude.context_window) == ("claude-haiku-4-5", "text", 4096)


# -- names -------------------------------------------------------------------------------------------
def test_served_name_and_aliases(served: Frontend) -> None:
    client = client_for(served)
    loads = health(served)["engine"]["model_loads"]
    reply = client.chat.completions.create(model=SERVED, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert reply.model == SERVED
    # Its repo id is the same model under the served name: no second load.
    reply = client.chat.completions.create(model=TEXT_REPO, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert reply.model == SERVED and health(served)["engine"]["model_loads"] == loads
    # A glob alias: an agent's hard-coded name reaches the served model under its name, no second load.
    for name in ("claude-sonnet-4-5-20250929", "claude-haiku-4-5"):
        reply = client.chat.completions.create(model=name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert reply.model == SERVED and health(served)["engine"]["model_loads"] == loads

    # An alias with its own settings: temperature 0 and max_tokens 3 by default, a 1024-token window.
    def small(**extra: object):
        return client.chat.completions.create(model="small", messages=[{"role": "user", "content": "Tell a story"}],
                                              extra_body={"ignore_eos": True}, **extra)

    first, second = small(), small()
    assert first.model == "small" and health(served)["loaded_model"] == "small"
    assert first.usage.completion_tokens == 3 and first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content == second.choices[0].message.content  # greedy by the alias' default
    assert small(max_tokens=6).usage.completion_tokens == 6  # a request's own value still wins
    clamped = small(max_tokens=2000)  # past the 1024-token window: lowered to what it has left (agents' habit)
    assert clamped.usage.prompt_tokens + clamped.usage.completion_tokens == 1024
    assert clamped.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="small", messages=[{"role": "user", "content": "word " * 1100}])
    assert refused.value.body["code"] == "context_length_exceeded" and "1024" in refused.value.body["message"]
    tokenized = httpx.post(f"{served.base_url}/v1/tokenize", json={"prompt": "hi"}, timeout=30).json()
    assert tokenized["max_model_len"] == 1024
    assert health(served)["engine"]["model_loads"] == loads + 1


def test_unknown_model_gets_404_listing_what_is_available(served: Frontend) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client_for(served).chat.completions.create(model="no-such-model", max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}])
    body = missing.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "Available models:" in body["message"]
    for name in (SERVED, "small", "local-tiny", TEXT_REPO):
        assert name in body["message"]


# -- chat templates -----------------------------------------------------------------------------------
def test_chat_template_file_applies_to_every_model_unless_its_entry_says_otherwise(served: Frontend) -> None:
    assert chat(served, SERVED, max_tokens=1).status_code == 200
    assert templated_text(served, SERVED) == "[user] hi\n[assistant] "  # --chat-template-file
    assert chat(served, "local-tiny", max_tokens=1).status_code == 200
    assert templated_text(served, "local-tiny") == "[user] hi\n[assistant] "
    assert chat(served, "custom-template", max_tokens=1).status_code == 200
    assert templated_text(served, "custom-template") == "<user>hi"  # the entry's own file
    assert chat(served, "own-template", max_tokens=1).status_code == 200
    own = templated_text(served, "own-template")  # `chat_template: model`: the model's Qwen template
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in own


def test_a_model_without_a_template_gets_a_clear_error_on_chat_routes(served: Frontend) -> None:
    r = chat(served, "bare", max_tokens=2)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "chat_template_missing" and error["param"] == "messages"
    assert "bare" in error["message"] and "/v1/completions" in error["message"]
    r = httpx.post(f"{served.base_url}/v1/completions", timeout=60,
                   json={"model": "bare", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_reasoning_parser_per_model(served: Frontend) -> None:
    client = client_for(served)

    def ask(model: str, **extra: object):
        return client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "Is 7 prime?"}],
                                              extra_body={"ignore_eos": True, **extra}).choices[0].message

    thinking = ask("thinker")  # the prompt opens <think>: everything is reasoning
    assert thinking.reasoning_content and not thinking.content
    # reasoning_parser: none: the same prompt (thinking asked for explicitly, as it is no longer the
    # template's default) gives the same text, now plain content.
    plain = ask("thinker-plain", chat_template_kwargs={"enable_thinking": True})
    assert plain.content == thinking.reasoning_content and not getattr(plain, "reasoning_content", None)


# -- configuration errors (no model needed) -----------------------------------------------------------


def test_engine_refuses_to_start_with_a_bad_models_config(tmp_path: Path, ipc_dir: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - alias: a\n")
    done = subprocess.run([sys.executable, "-m", "engine_daemon", "--endpoint", f"ipc://{ipc_dir}/bad-config.sock",
                           "--models-config", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "exactly one of 'path'" in done.stderr
