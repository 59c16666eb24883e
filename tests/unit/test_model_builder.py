"""Tests for model_builders.text: random-weight models that the real mlx_lm.load accepts.

Only the ``tiny`` preset is built here; ``realistic`` (~1.5 GB, ~20 s) is too slow for CI.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402

from model_builders import text as model_builder  # noqa: E402
from model_builders.hf_cache import place_in_hf_cache  # noqa: E402
from model_builders.text import PRESETS, build_model  # noqa: E402
from model_builders.tokenizer import ADDED_TOKENS  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
ARCHS = ["qwen2", "llama"]
CHAT = [{"role": "user", "content": "Hello there! What is the weather like in Paris today?"}]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(model_dir: Path) -> dict[str, tuple[int, str]]:
    """name -> (mtime_ns, sha256) of every visible file, to detect rewrites."""
    return {
        p.name: (p.stat().st_mtime_ns, _sha256(p))
        for p in sorted(model_dir.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def _greedy(model, tokenizer, max_tokens: int = 16):
    """Greedy stream_generate over the chat-templated CHAT prompt; returns (text, last response)."""
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    text, last = "", None
    for last in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        text += last.text
    return text, last


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> dict[str, Path]:
    """One tiny build per architecture (seed 0), shared by the whole session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(root / f"tiny-{arch}", size="tiny", seed=0, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def loaded(built) -> dict[str, tuple]:
    return {arch: mlx_lm.load(str(path)) for arch, path in built.items()}


# ------------------------------------------------------------------------------------------
# Loading and generation through the real mlx-lm
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_load_and_generate_16_tokens(built, arch):
    model, tokenizer = mlx_lm.load(str(built[arch]))  # strict weight loading is mlx_lm's default
    text, last = _greedy(model, tokenizer, 16)

    assert text.strip(), "random model produced no visible text"
    assert last.generation_tokens == 16 and last.finish_reason == "length"
    # mlx_lm.generate (the simple API) agrees with the streaming one.
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=16) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_config_matches_real_architecture(built, loaded, arch):
    config = json.loads((built[arch] / "config.json").read_text())
    preset = PRESETS["tiny"]
    assert config["model_type"] == arch
    assert config["mlx_engined_random_weights"] is True
    assert config["mlx_engined_build"]["seed"] == 0
    for key, value in preset.items():
        assert config[key] == value, key
    for key in ("rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id", "rms_norm_eps"):
        assert key in config
    assert config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is (arch == "qwen2")

    model, _ = loaded[arch]
    assert type(model).__module__ == f"mlx_lm.models.{arch}"
    params = dict(tree_flatten(model.parameters()))
    assert all(v.dtype == mx.float32 for v in params.values())
    assert ("lm_head.weight" in params) is (arch == "llama")
    # The file holds exactly the weights the model wants (strict load already checked names).
    on_disk = mx.load(str(built[arch] / "model.safetensors"))
    assert set(on_disk) == set(params)

    readme = (built[arch] / "README.md").read_text()
    assert "RANDOM WEIGHTS" in readme and "NOT A TRAINED MODEL" in readme


def test_generation_config(built):
    gen = json.loads((built["qwen2"] / "generation_config.json").read_text())
    vocab = PRESETS["tiny"]["vocab_size"]
    ids = {content: vocab - len(ADDED_TOKENS) + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert gen["pad_token_id"] == ids["<|endoftext|>"]
    assert gen["temperature"] == 0.7 and gen["top_p"] == 0.8 and gen["top_k"] == 20
    assert gen["repetition_penalty"] == 1.05


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_are_sane(loaded, arch):
    model, tokenizer = loaded[arch]
    params = dict(tree_flatten(model.parameters()))
    for name, value in params.items():
        if "norm" in name:
            assert mx.all(value == 1).item(), name
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    logits = model(mx.array([prompt]))[0, -1]
    assert mx.all(mx.isfinite(logits)).item()
    std = logits.std().item()
    assert 0.3 < std < 3.0, f"logit std {std} is degenerate"
    assert len(set(mx.argmax(model(mx.array([prompt]))[0], axis=-1).tolist())) > 1


def test_parameter_count_matches_shape(loaded):
    model, _ = loaded["qwen2"]
    p = PRESETS["tiny"]
    h, layers, inter, vocab = p["hidden_size"], p["num_hidden_layers"], p["intermediate_size"], p["vocab_size"]
    kv = h // p["num_attention_heads"] * p["num_key_value_heads"]
    attn = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k/v (+bias), o
    per_layer = attn + 3 * h * inter + 2 * h
    expected = vocab * h + layers * per_layer + h  # tied embeddings, final norm
    assert sum(v.size for _, v in tree_flatten(model.parameters())) == expected


# ------------------------------------------------------------------------------------------
# Determinism and idempotency
# ------------------------------------------------------------------------------------------


def test_same_seed_identical_different_seed_differs(built, loaded, tmp_path):
    again = build_model(tmp_path / "again", size="tiny", seed=0, arch="qwen2")
    other = build_model(tmp_path / "other", size="tiny", seed=1, arch="qwen2")
    ref = built["qwen2"]

    assert _sha256(again / "model.safetensors") == _sha256(ref / "model.safetensors")
    assert _sha256(other / "model.safetensors") != _sha256(ref / "model.safetensors")
    # The tokenizer depends on vocab_size only, not on the weight seed.
    assert (other / "tokenizer.json").read_bytes() == (ref / "tokenizer.json").read_bytes()

    ref_text, _ = _greedy(*loaded["qwen2"])
    again_text, _ = _greedy(*mlx_lm.load(str(again)))
    other_model, other_tok = mlx_lm.load(str(other))
    other_text, _ = _greedy(other_model, other_tok)
    assert again_text == ref_text
    prompt = other_tok.apply_chat_template(CHAT, add_generation_prompt=True)
    ref_logits = loaded["qwen2"][0](mx.array([prompt]))
    assert not mx.allclose(other_model(mx.array([prompt])), ref_logits).item()
    assert other_text != ref_text


def test_build_is_deterministic_across_processes(built, tmp_path):
    """A fresh interpreter (different hash seed) writes byte-identical files."""
    out = tmp_path / "subprocess-build"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(
        [sys.executable, "-m", "model_builders.text", str(out), "--size", "tiny", "--seed", "0"],
        check=True,
        env=env,
        capture_output=True,
        cwd=REPO_ROOT,
    )
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert _sha256(out / name) == _sha256(built["qwen2"] / name), name


def test_build_is_idempotent(tmp_path):
    out = build_model(tmp_path / "m", seed=3)
    before = _snapshot(out)
    assert build_model(out, seed=3) == out
    assert _snapshot(out) == before, "a complete build was rewritten"  # mtimes too: nothing written again

    # An incomplete build (missing file) is detected and rebuilt to the same bytes.
    (out / "tokenizer.json").unlink()
    build_model(out, seed=3)
    assert {k: v[1] for k, v in _snapshot(out).items()} == {k: v[1] for k, v in before.items()}

    # Asking for another seed in the same dir rebuilds it.
    build_model(out, seed=4)
    assert json.loads((out / "config.json").read_text())["mlx_engined_build"]["seed"] == 4
    assert _sha256(out / "model.safetensors") != before["model.safetensors"][1]


def test_refuses_to_overwrite_a_foreign_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(FileExistsError):
        build_model(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "qwen2"}


@pytest.mark.parametrize(
    "kwargs",
    [{"size": "huge"}, {"arch": "gpt2"}, {"seed": -1}, {"seed": "0"}, {"context_window": 100}],
)
def test_rejects_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError):
        build_model(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


def test_tokenizer_size_matches_config(built, loaded):
    vocab = PRESETS["tiny"]["vocab_size"]
    _, tokenizer = loaded["qwen2"]
    assert len(tokenizer) == vocab
    assert tokenizer.vocab_size == vocab
    assert json.loads((built["qwen2"] / "config.json").read_text())["vocab_size"] == vocab
    # Every id the model can emit maps to a token string.
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    assert all(isinstance(t, str) and t for t in tokens)


def test_tokenizer_is_byte_level_bpe_with_specials(built, loaded):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    _, tokenizer = loaded["qwen2"]
    data = json.loads((built["qwen2"] / "tokenizer.json").read_text())
    assert data["model"]["type"] == "BPE"
    assert data["decoder"]["type"] == "ByteLevel"
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)

    vocab = PRESETS["tiny"]["vocab_size"]
    for i, (content, special) in enumerate(ADDED_TOKENS):
        assert tokenizer.encode(content, add_special_tokens=False) == [vocab - len(ADDED_TOKENS) + i]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.eos_token_ids == {vocab - 5, vocab - 7}  # <|im_end|>, <|endoftext|>
    assert tokenizer.has_thinking and tokenizer.think_start == "<think>"
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    # Non-special markers survive skip_special_tokens (the tool/think parsers need them).
    ids = tokenizer.encode("<|im_start|>a<tool_call>b</tool_call><think>c</think><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call><think>c</think>"


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, the quick brown fox jumps over 12345 lazy dogs.",
        "  leading spaces\n\nblank lines\ttabs and trailing  ",
        "Ünïcödé — naïve café ✓ 你好 🙂",
        "don't stop: we're here, I'll see; it's {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
        "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call>",
    ],
)
def test_tokenizer_round_trips(loaded, built, text):
    from tokenizers import Tokenizer

    _, tokenizer = loaded["qwen2"]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # transformers and the raw tokenizers library agree on the ids.
    raw = Tokenizer.from_file(str(built["qwen2"] / "tokenizer.json"))
    assert raw.encode(text).ids == ids
    # mlx-lm's streaming detokenizer reproduces the text token by token, except that (by
    # design, like its SPM detokenizer) it drops one leading space at the very start.
    detok = tokenizer.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == (text[1:] if text.startswith(" ") else text)
    # BPE merges were learned: plain English takes far fewer tokens than bytes.
    if text.startswith("Hello"):
        assert len(ids) < len(text.encode()) / 2


def test_chat_template_is_qwen25_chatml(loaded):
    _, tokenizer = loaded["qwen2"]
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{CHAT[0]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(tools[0]) in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in rendered
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in rendered
    # mlx-lm's tool parser understands what the template asks the model to emit.
    call = tokenizer.tool_parser('{"name": "get_weather", "arguments": {"city": "Paris"}}', tools)
    assert call["name"] == "get_weather" and call["arguments"] == {"city": "Paris"}


def test_tokenizer_files(built):
    cfg = json.loads((built["qwen2"] / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["bos_token"] is None and cfg["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in cfg["chat_template"] and "<tools>" in cfg["chat_template"]
    assert cfg["model_max_length"] == PRESETS["tiny"]["max_position_embeddings"]
    stm = json.loads((built["qwen2"] / "special_tokens_map.json").read_text())
    assert stm["eos_token"]["content"] == "<|im_end|>"


def test_import_is_light():
    code = (
        "import sys, model_builders.text as m; "
        "heavy = [x for x in ('mlx', 'mlx_lm', 'tokenizers', 'transformers', 'huggingface_hub') if x in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert out.stdout.strip() == ""


# ------------------------------------------------------------------------------------------
# Hugging Face cache layout
# ------------------------------------------------------------------------------------------


def test_place_in_hf_cache(built, tmp_path):
    import huggingface_hub

    cache = tmp_path / "hub"
    repo_id = "mlx-engined/tiny-random-qwen2"
    snapshot = place_in_hf_cache(built["qwen2"], repo_id, cache)

    repo_root = cache / "models--mlx-engined--tiny-random-qwen2"
    commit = (repo_root / "refs" / "main").read_text()
    assert len(commit) == 40 and int(commit, 16) >= 0
    assert snapshot == repo_root / "snapshots" / commit

    # Layout: relative symlinks into blobs/, LFS blobs named by sha256, others by git sha1.
    weights = snapshot / "model.safetensors"
    blob = _sha256(built["qwen2"] / "model.safetensors")
    assert weights.is_symlink() and os.readlink(weights) == f"../../blobs/{blob}"
    config_bytes = (built["qwen2"] / "config.json").read_bytes()
    git_sha1 = hashlib.sha1(b"blob %d\0" % len(config_bytes) + config_bytes).hexdigest()
    assert os.readlink(snapshot / "config.json") == f"../../blobs/{git_sha1}"
    assert not any(p.name.startswith(".") for p in snapshot.iterdir()), "build lock leaked into the snapshot"

    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = [r for r in info.repos if r.repo_id == repo_id]
    assert repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.commit_hash == commit and "main" in revision.refs
    assert {f.file_name for f in revision.files} == {p.name for p in snapshot.iterdir()}

    resolved = huggingface_hub.snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    assert Path(resolved) == snapshot
    # What mlx-lm asks for (its allow patterns) is complete according to the tree cache too.
    resolved = huggingface_hub.snapshot_download(
        repo_id, cache_dir=cache, local_files_only=True, allow_patterns=["*.json", "model*.safetensors"]
    )
    assert Path(resolved) == snapshot
    if hasattr(huggingface_hub, "get_cached_repo_tree"):
        tree = huggingface_hub.get_cached_repo_tree(repo_id, cache_dir=cache)
        assert {f.path for f in tree} == {p.name for p in snapshot.iterdir()}

    model, tokenizer = mlx_lm.load(resolved)
    text, _ = _greedy(model, tokenizer, 4)
    assert text

    # Placing again is a no-op that yields the same snapshot.
    assert place_in_hf_cache(built["qwen2"], repo_id, cache) == snapshot
    assert len(list((repo_root / "snapshots").iterdir())) == 1


def test_mlx_lm_loads_by_repo_id_offline(built, tmp_path):
    """mlx_lm.load("org/name") finds the placed model through HF_HUB_CACHE, with the Hub offline."""
    cache = tmp_path / "hub"
    snapshot = place_in_hf_cache(built["qwen2"], "org/tiny-by-id", cache)
    code = (
        "import mlx_lm, mlx_lm.utils as u; "
        "m, t = mlx_lm.load('org/tiny-by-id'); "
        "print(u._download('org/tiny-by-id')); "
        "print(len(t))"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    path, size = out.stdout.split()
    assert Path(path) == snapshot and int(size) == PRESETS["tiny"]["vocab_size"]


def test_place_in_hf_cache_other_revision(built, tmp_path):
    import huggingface_hub

    cache = tmp_path / "hub"
    snapshot = place_in_hf_cache(built["llama"], "org/tiny-llama", cache, revision="v1")
    found = huggingface_hub.snapshot_download("org/tiny-llama", cache_dir=cache, revision="v1", local_files_only=True)
    assert Path(found) == snapshot


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------


def test_cli_main(tmp_path, capsys):
    out = tmp_path / "cli"
    cache = tmp_path / "hub"
    rc = model_builder.main(
        [str(out), "--size", "tiny", "--seed", "2", "--arch", "llama", "--hf-repo-id", "org/cli",
         "--hf-cache-dir", str(cache)]
    )
    assert rc == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed.parent == cache / "models--org--cli" / "snapshots"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["mlx_engined_build"]["seed"] == 2


def test_context_window_is_what_the_model_advertises(tmp_path):
    """Agents' first prompts exceed the default 32k window; the window is a build option (RoPE: no table)."""
    out = tmp_path / "wide"
    assert model_builder.main([str(out), "--context-window", "131072"]) == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 131072
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 131072


def test_cli_rejects_unknown_size(tmp_path):
    with pytest.raises(SystemExit):
        model_builder.main([str(tmp_path / "x"), "--size", "enormous"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ends_after_makes_every_reply_end(tmp_path, temperature):
    """--ends-after N: N word tokens, then <|im_end|>, greedy or sampled, whatever the prompt."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    path = build_model(tmp_path / "ends", size="tiny", seed=0, ends_after=5)
    model, tokenizer = mlx_lm.load(str(path))
    replies = set()
    for prompt in ["hi", "Write a long essay about ships and the sea. " * 30]:
        tokens = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        reply = generate(model, tokenizer, tokens, max_tokens=50, sampler=make_sampler(temp=temperature))
        assert len(reply.split()) == 5  # five word tokens, then the end token stopped it
        replies.add(reply)
    assert len(replies) == 1
    assert json.loads((path / "config.json").read_text())["mlx_engined_build"]["ends_after"] == 5
