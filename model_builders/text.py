"""Build small random-weight MLX text models that the real ``mlx_lm.load`` accepts.

Why this exists: the engine's tests and benchmarks, and users smoke-testing a deployment,
need a model directory that goes through exactly the same loading path as a real
checkpoint (``config.json`` + ``model.safetensors`` + a Hugging Face tokenizer with a
chat template), but without network access and without multi-gigabyte downloads.

What it writes (``build_model``):

* ``config.json`` for a real mlx-lm architecture (``qwen2`` or ``llama``), marked with
  ``"mlx_engined_random_weights": true`` so nobody mistakes it for a trained model;
* ``model.safetensors`` with seeded random float32 weights (normal with std 1/sqrt(fan_in),
  residual projections further scaled by 1/sqrt(2 * layers), norms = 1, biases = 0) so that
  logits have unit spread at every size: neither degenerate (all equal) nor exploding;
* a byte-level BPE tokenizer trained offline on a deterministic, locally generated
  English-like corpus, with the Qwen2 pre-tokenizer and ``ByteLevel`` decoder (so mlx-lm picks
  its BPE streaming detokenizer), ChatML special tokens, ``<tool_call>``/``<think>`` tokens,
  and exactly ``vocab_size`` entries so every id the model can emit decodes to something;
* ``tokenizer_config.json`` with the real Qwen2.5 chat template (tools section included),
  ``special_tokens_map.json``, ``generation_config.json`` and a ``README.md`` that says
  RANDOM WEIGHTS.

``place_in_hf_cache`` then lays such a directory out exactly like ``huggingface_hub`` lays
out its cache, so code paths that resolve repo ids (``snapshot_download(...,
local_files_only=True)``, ``scan_cache_dir``) can be tested offline.

Nothing heavy happens at import time: mlx, mlx-lm and tokenizers are imported lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

__all__ = ["PRESETS", "ARCHS", "build_model", "place_in_hf_cache", "main"]

# Bump whenever the bytes written for a given (size, seed, arch) change, so that the
# idempotency check in build_model() rebuilds stale directories instead of reusing them.
BUILDER_VERSION = 2

MARKER_KEY = "mlx_engined_random_weights"
BUILD_INFO_KEY = "mlx_engined_build"

# Architecture-neutral shapes. Keys are Hugging Face config.json keys, so a preset can be
# pasted into a config as is. ``vocab_size`` is also the exact tokenizer size.
PRESETS: dict[str, dict] = {
    # Loads and generates in well under a second on CPU; big enough vocab that the BPE
    # tokenizer has real merges (words, not just bytes) and random text looks like text.
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        # head_dim 32: the smallest MLX's quantized KV cache supports (group sizes 32/64/128).
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 128,
        "vocab_size": 2048,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
    },
    # Qwen2-0.5B shape with a 32k vocab: ~386.6M float32 parameters (~1.5 GB), which gives
    # benchmark numbers (memory bandwidth, KV cache size per token) of a real small model.
    "realistic": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
    },
}

# Per-architecture config fields. Llama keeps an untied lm_head (like Llama 3 8B) so that
# both the tied and the untied output paths of mlx-lm get exercised.
ARCHS: dict[str, dict] = {
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    },
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    },
}

# Added tokens, in Qwen's order, placed at the very end of the vocabulary (as Qwen does).
# ``special`` follows Qwen2.5/Qwen3: ChatML markers are special (skipped by
# ``skip_special_tokens``); tool-call and think markers are not, so they survive decoding and
# the tool / reasoning parsers can see them.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<think>", False),
    ("</think>", False),
)
FILLER_TOKEN = "<|extra_{}|>"

# Qwen2's pre-tokenizer split (identical to transformers' Qwen2Tokenizer PRETOKENIZE_REGEX).
# transformers >= 5 rebuilds the Qwen2 pipeline from vocab + merges with this regex, so the
# tokenizer.json must use the very same one for both loaders to tokenize identically.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The chat template shipped in Qwen/Qwen2.5-*-Instruct tokenizer_config.json, verbatim.
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{\"name\": \"' }}
            {{- tool_call.name }}
            {{- '\", \"arguments\": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Sampling defaults as Qwen2.5-Instruct ships them, so the engine's "use the model's
# generation_config" path sees realistic values.
GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}

# Files of a complete build. config.json is written last and acts as the commit marker.
_PAYLOAD_FILES = (
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "README.md",
)
_CONFIG_FILE = "config.json"
_LOCK_FILE = ".mlx_engined_build.lock"


# --------------------------------------------------------------------------------------
# Corpus + tokenizer
# --------------------------------------------------------------------------------------

_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so
these her long make thing see him two has look more day could go come did number sound no
most people my over know water than call first who may down side been now find any new work
part take get place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air
well also play small end put home read hand port large spell add even land here must big high
such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found
answer school grow study still learn plant cover food sun four between state keep eye never
last let thought city tree cross farm hard start might story saw far sea draw left late run
while press close night real life few north open seem together next white children begin got
walk example ease paper group always music those both mark often letter until mile river car
feet care second book carry took science eat room friend began idea fish mountain stop once
base hear horse cut sure watch color face wood main enough plain girl usual young ready above
ever red list though feel talk bird soon body dog family direct pose leave song measure door
product black short numeral class wind question happen complete ship area half rock order
fire south problem piece told knew pass since top whole king space heard best hour better true
during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit
power town fine certain fly fall lead cry dark machine note wait plan figure star box noun
field rest correct able pound done beauty drive stood contain front teach week final gave
green quick develop ocean warm free minute strong special mind behind clear tail produce fact
street inch multiply nothing course stay wheel full force blue object decide surface deep moon
island foot system busy test record boat common gold possible plane dry wonder laugh thousand
ago ran check game shape miss brought heat snow tire bring yes distant fill east paint
language among model server request response token stream error value function weather city
don't it's I'm we're you'll can't that's he'd they've isn't
""".split()
_ONSETS = (
    "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sm sn "
    "sp st str sw th tr qu"
).split()
_VOWELS = "a e i o u y ai ea ee oa oo ou ie".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rk", "st", "ck", "x", "th"]
_SENTENCE_END = [".", ".", ".", ".", "?", "!", ":", ";"]
_CORPUS_SEED = 20240601


def _generate_corpus(n_chars: int) -> Iterator[str]:
    """Yields ~n_chars of deterministic English-like text in chunks.

    Why this shape: common English words give the BPE trainer realistic frequent merges, a
    large lexicon of pronounceable pseudo-words gives it enough distinct words to reach a
    32k vocabulary, and digits / punctuation / JSON-ish lines cover what prompts and tool
    calls contain. Seeded ``random.Random`` keeps it identical across runs and machines.
    """
    rng = random.Random(_CORPUS_SEED)
    lexicon = []
    for _ in range(60000):
        n_syll = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        lexicon.append(
            "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syll))
        )
    n_common = len(_COMMON_WORDS)
    parts: list[str] = []
    chunk_chars = 0  # characters in the current (not yet yielded) chunk
    total_chars = 0
    while total_chars < n_chars:
        if rng.random() < 0.03:
            # A tool-call-like JSON line, so braces/quotes/colons get merged like in real prompts.
            arguments = {rng.choice(_COMMON_WORDS): rng.choice(lexicon), "n": rng.randint(0, 999)}
            sentence = json.dumps({"name": rng.choice(lexicon), "arguments": arguments}) + "\n"
        else:
            words = []
            for _ in range(rng.randint(4, 18)):
                r = rng.random()
                if r < 0.3:  # Zipf-like: the first common words dominate, as in English
                    word = _COMMON_WORDS[min(int(rng.paretovariate(1.1)) - 1, n_common - 1)]
                elif r < 0.55:
                    word = rng.choice(_COMMON_WORDS)
                elif r < 0.93:
                    word = lexicon[min(int(rng.expovariate(1 / 8000)), len(lexicon) - 1)]
                else:
                    word = str(rng.randint(0, 10 ** rng.randint(1, 6)))
                if rng.random() < 0.05:
                    word = word.capitalize()
                if rng.random() < 0.06:
                    word += ","
                words.append(word)
            text = " ".join(words).rstrip(",")
            sentence = text[0].upper() + text[1:] + rng.choice(_SENTENCE_END)
            sentence += "\n\n" if rng.random() < 0.1 else " "
        parts.append(sentence)
        chunk_chars += len(sentence)
        total_chars += len(sentence)
        if chunk_chars >= 100_000:
            yield "".join(parts)
            parts, chunk_chars = [], 0
    if parts:
        yield "".join(parts)


@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int) -> str:
    """Returns the tokenizer.json text of a byte-level BPE with exactly ``vocab_size`` ids.

    Training is deterministic (fixed corpus, the Rust trainer breaks ties by pair order) and
    fast (~0.3 s for 2k, ~2 s for 32k on 2 CPU cores), so it is redone per process rather than cached on
    disk; the in-process lru_cache only spares tests from training twice.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    n_added = len(ADDED_TOKENS)
    n_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < n_bytes + n_added:
        raise ValueError(f"vocab_size must be at least {n_bytes + n_added} (256 byte tokens + {n_added} added tokens)")
    bpe_size = vocab_size - n_added

    def configure(tok: Tokenizer) -> None:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()

    t0 = time.perf_counter()
    trainee = Tokenizer(BPE())
    configure(trainee)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # ~100 characters of corpus per wanted token is plenty for the trainer to reach the size.
    trainee.train_from_iterator(_generate_corpus(max(200_000, 100 * bpe_size)), trainer=trainer)
    trained = json.loads(trainee.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in trained["merges"]]

    # Pad a short vocabulary so every id below vocab_size decodes to something, then put the
    # added tokens at the very end (as Qwen does). They also go into the BPE vocab itself so
    # that ``tokenizer.vocab_size == len(tokenizer) == config.vocab_size``.
    shortfall = bpe_size - len(vocab)
    if shortfall:
        logger.warning("BPE trainer stopped at %d tokens; padding with %d filler tokens", len(vocab), shortfall)
    fillers = [FILLER_TOKEN.format(i) for i in range(shortfall)]
    for content in fillers + [c for c, _ in ADDED_TOKENS]:
        vocab[content] = len(vocab)
    assert len(vocab) == vocab_size

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    configure(tok)
    tok.add_tokens([AddedToken(c, special=False, normalized=False) for c in fillers])
    tok.add_special_tokens([AddedToken(c, special=s, normalized=False) for c, s in ADDED_TOKENS])
    # add_special_tokens marks everything special; restore Qwen's flags for <tool_call> etc.
    data = json.loads(tok.to_str())
    flags = dict(ADDED_TOKENS)
    for entry in data["added_tokens"]:
        entry["special"] = flags.get(entry["content"], False)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    logger.debug("trained %d-token BPE in %.2fs", vocab_size, time.perf_counter() - t0)
    return json.dumps(data, ensure_ascii=False, indent=2)


def _token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the added tokens: always the last len(ADDED_TOKENS) ids of the vocabulary."""
    first = vocab_size - len(ADDED_TOKENS)
    return {content: first + i for i, (content, _) in enumerate(ADDED_TOKENS)}


def _tokenizer_config(vocab_size: int, max_len: int) -> dict:
    ids = _token_ids(vocab_size)
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in ADDED_TOKENS
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _special_tokens_map() -> dict:
    def tok(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    return {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": tok(IM_END),
        "pad_token": tok(ENDOFTEXT),
    }


# --------------------------------------------------------------------------------------
# Config + weights
# --------------------------------------------------------------------------------------


def _model_config(size: str, seed: int, arch: str) -> dict:
    """The full config.json (minus the file manifest) for a build; also the idempotency key."""
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    preset = PRESETS[size]
    ids = _token_ids(preset["vocab_size"])
    config = {**copy.deepcopy(ARCHS[arch]), **copy.deepcopy(preset)}
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ValueError("hidden_size must be divisible by num_attention_heads")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
    if arch == "llama":
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config.update(
        {
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[ENDOFTEXT],
            "torch_dtype": "float32",
            "use_cache": True,
            MARKER_KEY: True,
            BUILD_INFO_KEY: {
                "builder_version": BUILDER_VERSION,
                "size": size,
                "seed": seed,
                "arch": arch,
                "note": "RANDOM WEIGHTS, NOT A TRAINED MODEL. Built by model_builders.text.",
            },
        }
    )
    return dict(sorted(config.items()))


def _generation_config(config: dict) -> dict:
    ids = _token_ids(config["vocab_size"])
    return {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
        **GENERATION_DEFAULTS,
    }


def _mlx_model(config: dict):
    """Instantiates the mlx-lm model class for ``config`` exactly as ``mlx_lm.load`` would."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config=config)
    return model_class(args_class.from_dict(config))


def _random_weights(config: dict, seed: int) -> dict:
    """Seeded random weights keyed by the names mlx-lm's ``load_weights(strict=True)`` wants.

    Why instantiate the mlx-lm class: its parameter tree *is* the checkpoint layout mlx-lm
    expects (HF names, e.g. ``model.layers.0.self_attn.q_proj.weight``), so names and shapes
    can never drift from what the loader checks. The module's own init is lazy and is never
    evaluated; every tensor is re-drawn from a per-name key split off ``mx.random.key(seed)``
    (sorted names, so the result does not depend on traversal order).

    Why std = 1/sqrt(fan_in) rather than a flat 0.02: with a flat 0.02 the tiny preset's
    blocks barely touch the residual stream, so the tied embedding makes the model echo its
    input token and the logits are nearly uniform (std ~0.16). Fan-in scaling gives logits
    with std ~1 for both presets and lets attention/MLP dominate the embedding.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model = _mlx_model(config)
    shapes = dict(tree_flatten(model.parameters()))
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(seed), len(names))
    residual_scale = 1.0 / (2 * config["num_hidden_layers"]) ** 0.5
    weights = {}
    for i, name in enumerate(names):
        shape = shapes[name].shape
        module = name.rsplit(".", 2)[-2]
        if name.endswith(".bias"):
            weights[name] = mx.zeros(shape, dtype=mx.float32)
        elif len(shape) == 1 and "norm" in name:
            weights[name] = mx.ones(shape, dtype=mx.float32)
        else:
            # Embeddings (vocab, hidden) and Linear weights (out, in): std = 1/sqrt(last dim).
            std = shape[-1] ** -0.5
            if module in ("o_proj", "down_proj"):
                std *= residual_scale
            weights[name] = mx.random.normal(shape, dtype=mx.float32, key=keys[i]) * std
    # Same checks mlx_lm.load performs: sanitize() first, then strict name/shape matching.
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    return weights


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _atomic_write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def _readme(config: dict, n_params: int) -> str:
    info = config[BUILD_INFO_KEY]
    return f"""# RANDOM WEIGHTS - NOT A TRAINED MODEL

This directory was generated by `model_builders.text` (mlx-engined) for tests,
benchmarks and deployment smoke tests. **Its weights are random noise.** It will produce
fluent-looking gibberish at best. Do not evaluate, fine-tune, publish or serve it as a model.

| field | value |
|---|---|
| architecture | `{config['model_type']}` |
| size preset | `{info['size']}` |
| seed | `{info['seed']}` |
| parameters | {n_params:,} (float32) |
| hidden / layers / heads / kv heads | {config['hidden_size']} / {config['num_hidden_layers']} / {config['num_attention_heads']} / {config['num_key_value_heads']} |
| intermediate / vocab | {config['intermediate_size']} / {config['vocab_size']} |

* `config.json` carries `"{MARKER_KEY}": true`.
* The tokenizer is a byte-level BPE trained offline on a synthetic English-like corpus, with
  ChatML special tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`), `<tool_call>`,
  `</tool_call>`, `<think>`, `</think>`, and the Qwen2.5 chat template.
* Same `(size, seed, arch)` and builder version give byte-identical weights.

Rebuild with:

    python -m model_builders.text OUT_DIR --size {info['size']} --seed {info['seed']} --arch {config['model_type']}
"""


def _read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_complete_build(out_dir: Path, expected: dict, payload_files: tuple[str, ...] = _PAYLOAD_FILES) -> bool:
    """True when out_dir holds a finished build of exactly ``expected`` (config incl. build info)."""
    on_disk = _read_json(out_dir / _CONFIG_FILE)
    if on_disk is None:
        return False
    info = dict(on_disk.get(BUILD_INFO_KEY) or {})
    manifest = info.pop("files", None)
    if not isinstance(manifest, dict) or {**on_disk, BUILD_INFO_KEY: info} != expected:
        return False
    for name in payload_files:
        try:
            if (out_dir / name).stat().st_size != manifest.get(name):
                return False
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Serialises concurrent builds of one directory (e.g. pytest-xdist workers)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(out_dir / _LOCK_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_build(out_dir: Path, config: dict, payload_files: tuple[str, ...],
                write_payload: Callable[[Path], None]) -> bool:
    """The idempotent build protocol every builder shares; True when it built, False when it reused.

    A complete build is detected from config.json (written last, atomically, with the
    builder version and a size manifest of the payload files), so a crashed or partial
    build is never mistaken for a finished one and is simply rebuilt. A directory whose
    config.json is not one of ours is refused rather than overwritten, so a real
    checkpoint cannot be clobbered. Concurrent builders of one directory serialise.
    """
    if _is_complete_build(out_dir, config, payload_files):
        return False
    existing = _read_json(out_dir / _CONFIG_FILE)
    if (out_dir / _CONFIG_FILE).exists() and not (existing or {}).get(MARKER_KEY):
        raise FileExistsError(f"{out_dir} holds a config.json not written by a builder; refusing to overwrite it")
    out_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        if _is_complete_build(out_dir, config, payload_files):  # another process finished it meanwhile
            return False
        # Invalidate first: from here until the final config.json write the dir is "incomplete".
        (out_dir / _CONFIG_FILE).unlink(missing_ok=True)
        write_payload(out_dir)
        final = copy.deepcopy(config)
        final[BUILD_INFO_KEY]["files"] = {name: (out_dir / name).stat().st_size for name in payload_files}
        _atomic_write_json(out_dir / _CONFIG_FILE, final)
    return True


def save_weights(out_dir: Path, weights: dict) -> int:
    """Writes model.safetensors atomically; returns the parameter count."""
    import mlx.core as mx

    n_params = sum(int(w.size) for w in weights.values())
    tmp = out_dir / f".tmp-{os.getpid()}-model.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, out_dir / "model.safetensors")
    return n_params


def build_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, arch: str = "qwen2") -> Path:
    """Writes the model dir (idempotent: if out_dir already holds a complete build with the same size/seed/arch, return at once without rebuilding) and returns its path.

    Why idempotent: tests, benchmarks and CI call this on every run (see `write_build`).
    """
    out_dir = Path(out_dir).expanduser().resolve()
    config = _model_config(size, seed, arch)

    def write_payload(out: Path) -> None:
        t0 = time.perf_counter()
        n_params = save_weights(out, _random_weights(config, seed))
        logger.info("wrote %s weights (%.1fM params) in %.1fs", size, n_params / 1e6, time.perf_counter() - t0)
        _atomic_write_bytes(out / "tokenizer.json", _train_tokenizer_json(config["vocab_size"]).encode())
        _atomic_write_json(out / "tokenizer_config.json",
                           _tokenizer_config(config["vocab_size"], config["max_position_embeddings"]))
        _atomic_write_json(out / "special_tokens_map.json", _special_tokens_map())
        _atomic_write_json(out / "generation_config.json", _generation_config(config))
        _atomic_write_bytes(out / "README.md", _readme(config, n_params).encode())

    t0 = time.perf_counter()
    if write_build(out_dir, config, _PAYLOAD_FILES, write_payload):
        logger.info("built %s/%s seed=%d in %s (%.1fs)", arch, size, seed, out_dir, time.perf_counter() - t0)
    else:
        logger.info("reusing existing build in %s", out_dir)
    return out_dir


# A thinking model's generation prompt (Qwen3-Thinking / DeepSeek-R1 style): the answer opens
# inside <think>, and `enable_thinking: false` renders an empty, closed block instead.
THINKING_GENERATION_PROMPT = r"""{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""


def thinking_chat_template() -> str:
    """The Qwen2.5 template (tools included) with a thinking generation prompt."""
    head, sep, _ = QWEN25_CHAT_TEMPLATE.rpartition("{%- if add_generation_prompt %}")
    assert sep, "the Qwen2.5 template lost its generation prompt"
    return head + THINKING_GENERATION_PROMPT


def derive_model(src: str | Path, dst: str | Path, chat_template: str) -> Path:
    """A copy of a built model (weights hard-linked) with another chat template.

    Tests use it for model variants that differ only in their template, such as a
    thinking model, without building (or storing) a second set of weights.
    """
    src, dst = Path(src).resolve(), Path(dst).expanduser().resolve()
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.startswith(".") and path.name != "tokenizer_config.json":
            _link_or_copy(path, dst / path.name)
    config = _read_json(src / "tokenizer_config.json") or {}
    config["chat_template"] = chat_template
    _atomic_write_json(dst / "tokenizer_config.json", config)
    return dst


# --------------------------------------------------------------------------------------
# Hugging Face cache layout
# --------------------------------------------------------------------------------------

_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".npz", ".pt", ".pth", ".model", ".tiktoken")
_LFS_MIN_SIZE = 10 * 1024 * 1024
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def _hash_file(path: Path, algo: str, prefix: bytes = b"") -> str:
    h = hashlib.new(algo)
    h.update(prefix)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_sha1(data_or_path: bytes | Path) -> str:
    if isinstance(data_or_path, bytes):
        return hashlib.sha1(b"blob %d\0" % len(data_or_path) + data_or_path).hexdigest()
    size = data_or_path.stat().st_size
    return _hash_file(data_or_path, "sha1", b"blob %d\0" % size)


def _link_or_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".tmp-{os.getpid()}-{dst.name}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _check_resolves(repo_id: str, cache_dir: Path, revision: str, snapshot: Path) -> None:
    """Fails loudly if huggingface_hub itself would not resolve what we just laid out."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub comes with mlx-lm
        return
    resolved = snapshot_download(repo_id, cache_dir=cache_dir, revision=revision, local_files_only=True)
    if Path(resolved).resolve() != snapshot.resolve():
        raise RuntimeError(f"huggingface_hub resolved {repo_id}@{revision} to {resolved}, not {snapshot}")


def place_in_hf_cache(model_dir: str | Path, repo_id: str, cache_dir: str | Path, revision: str = "main") -> Path:
    """Lays the model out exactly as huggingface_hub lays out its cache: <cache_dir>/models--<org>--<name>/{blobs/<sha256 or git-sha1 of file>, snapshots/<40-hex commit>/<file> -> symlinks to ../../blobs/..., refs/<revision> containing the commit hash}. Returns the snapshot dir. Verify with huggingface_hub.scan_cache_dir(cache_dir) that the repo is seen, and that huggingface_hub.snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True) returns the snapshot path.

    Why: lets the engine's "resolve a Hub repo id offline" paths be tested with a real
    cache layout. Details that mirror a real download: large/binary files are LFS objects
    whose blob is named by the sha256 of the content, other files by their git blob sha1;
    ``trees/<commit>.json`` (huggingface_hub >= 1.x tree-listing cache) records every file so
    completeness checks pass; the commit hash is derived from the file list and contents, so
    placing the same model twice is a no-op and a different model gets a new snapshot.
    Hidden files (e.g. the build lock) are skipped. Blobs are hard links when possible.
    If ``revision`` is itself a 40-hex commit hash it is used as the snapshot name.
    """
    model_dir = Path(model_dir).expanduser().resolve()
    cache_dir = Path(cache_dir).expanduser().resolve()
    if repo_id.count("/") > 1 or not repo_id.strip("/") or ".." in repo_id:
        raise ValueError(f"invalid repo_id {repo_id!r}")
    files = sorted(
        p
        for p in model_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(model_dir).parts)
    )
    if not files:
        raise FileNotFoundError(f"no files to place in {model_dir}")

    entries: dict[str, dict] = {}
    for path in files:
        rel = path.relative_to(model_dir).as_posix()
        size = path.stat().st_size
        if path.suffix in _LFS_SUFFIXES or size >= _LFS_MIN_SIZE:
            sha256 = _hash_file(path, "sha256")
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
            entries[rel] = {
                "path": path,
                "blob": sha256,
                "tree": {"size": size, "blob_id": _git_blob_sha1(pointer), "lfs_sha256": sha256, "lfs_size": size},
            }
        else:
            sha1 = _git_blob_sha1(path)
            entries[rel] = {"path": path, "blob": sha1, "tree": {"size": size, "blob_id": sha1}}

    if _COMMIT_RE.match(revision):
        commit = revision
    else:
        manifest = "\n".join(f"{rel} {e['tree']['blob_id']}" for rel, e in sorted(entries.items()))
        commit = hashlib.sha1(f"mlx-engined random model\n{repo_id}\n{manifest}\n".encode()).hexdigest()

    repo_root = cache_dir / ("models--" + repo_id.replace("/", "--"))
    blobs = repo_root / "blobs"
    snapshot = repo_root / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)

    for rel, e in entries.items():
        blob = blobs / e["blob"]
        if not blob.exists() or blob.stat().st_size != e["tree"]["size"]:
            _link_or_copy(e["path"], blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(blob, link.parent)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        tmp = link.with_name(f".tmp-{os.getpid()}-{link.name}")
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, link)

    trees = repo_root / "trees"
    trees.mkdir(exist_ok=True)
    _atomic_write_json(
        trees / f"{commit}.json",
        {"format_version": 1, "files": {rel: entries[rel]["tree"] for rel in sorted(entries)}},
    )
    if not _COMMIT_RE.match(revision):
        ref = repo_root / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_bytes(ref, commit.encode())  # no trailing newline, as huggingface_hub writes it
    _check_resolves(repo_id, cache_dir, revision, snapshot)
    logger.info("placed %s as %s@%s in %s", model_dir, repo_id, revision, snapshot)
    return snapshot


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="engined-build-model",
        description="Build a RANDOM-WEIGHT mlx-lm model directory for tests, benchmarks and smoke tests.",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write (reused if it already holds this build)")
    parser.add_argument("--size", choices=sorted(PRESETS), default="tiny", help="shape preset (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen2", help="architecture (default: qwen2)")
    parser.add_argument("--hf-repo-id", help="also place the model in a Hugging Face cache under this repo id")
    parser.add_argument("--hf-cache-dir", type=Path, help="cache dir for --hf-repo-id (default: huggingface_hub's)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if args.hf_cache_dir and not args.hf_repo_id:
        parser.error("--hf-cache-dir needs --hf-repo-id")
    return args


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``engined-build-model``); prints the resulting path on stdout."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    path = build_model(args.out_dir, size=args.size, seed=args.seed, arch=args.arch)
    if args.hf_repo_id:
        cache_dir = args.hf_cache_dir
        if cache_dir is None:
            from huggingface_hub import constants

            cache_dir = Path(constants.HF_HUB_CACHE)
        path = place_in_hf_cache(path, args.hf_repo_id, cache_dir)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
