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
import copy
import logging
import sys
import time
from pathlib import Path
from typing import Any

from model_builders.ending import chain_tokens, make_it_end
from model_builders.files import (
    BUILD_INFO_KEY,
    MARKER_KEY,
    PAYLOAD_FILES,
    atomic_write_bytes,
    atomic_write_json,
    link_or_copy,
    read_json,
    save_weights,
    write_build,
)
from model_builders.hf_cache import place_in_hf_cache
from model_builders.tokenizer import (
    ENDOFTEXT,
    IM_END,
    special_tokens_map,
    token_ids,
    tokenizer_config,
    train_tokenizer_json,
    with_bos_token,
)

logger = logging.getLogger(__name__)

__all__ = ["PRESETS", "ARCHS", "build_model", "derive_model", "main"]

# Bump whenever the bytes written for a given (size, seed, arch) change, so that the
# idempotency check in build_model() rebuilds stale directories instead of reusing them.
BUILDER_VERSION = 2

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
    # Engine groups' tests: four layers (two per pipeline stage), four query and two KV heads (two per
    # tensor-parallel rank), float32 like every preset (bf16/4-bit TP rounds differently from one process).
    "tiny-group": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 2048,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
    },
    # The mid-size benchmark model: ~85.3M float32 parameters (~340 MB). Big enough that a
    # decode step is bound by weight reads like a real model, small enough that CPU runs
    # finish in minutes; the issue tracker's throughput figures are taken on this shape.
    "small": {
        "hidden_size": 640,
        "num_hidden_layers": 12,
        "num_attention_heads": 10,
        "num_key_value_heads": 2,
        "intermediate_size": 2304,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
    },
    # An 8B model's KV per token (Llama 3 8B: 32 layers x 8 KV heads x 128 in bf16, 128 KB) on ~150M float32
    # parameters: 16 layers x 8 KV heads x 128 in float32. For the disk tier's benchmarks, where what matters
    # is how many bytes a prefix's KV takes (~0.5 GB for 4,000 tokens), at a compute a CPU run can afford.
    "wide-kv": {
        "hidden_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 1024,
        "vocab_size": 32000,
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

# Sampling defaults as Qwen2.5-Instruct ships them, so the engine's "use the model's
# generation_config" path sees realistic values.
GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}


# --------------------------------------------------------------------------------------
# Config + weights
# --------------------------------------------------------------------------------------


def _model_config(size: str, seed: int, arch: str, ends_after: int | None = None,
                  context_window: int | None = None) -> dict:
    """The full config.json (minus the file manifest) for a build; also the idempotency key."""
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    preset = PRESETS[size]
    ids = token_ids(preset["vocab_size"])
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
    if ends_after is not None:  # a model that ends its replies (`model_builders.ending`)
        if isinstance(ends_after, bool) or not isinstance(ends_after, int) or not 1 <= ends_after < 48:
            raise ValueError(f"ends_after must be an int in 1..47, got {ends_after!r}")
        config["tie_word_embeddings"] = False
        config[BUILD_INFO_KEY]["ends_after"] = ends_after
    if context_window is not None:  # RoPE models have no position table: only the advertised window changes
        if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 256:
            raise ValueError(f"context_window must be an int >= 256, got {context_window!r}")
        config["max_position_embeddings"] = context_window
    return dict(sorted(config.items()))


def _generation_config(config: dict) -> dict:
    ids = token_ids(config["vocab_size"])
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


def build_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, arch: str = "qwen2",
                ends_after: int | None = None, context_window: int | None = None) -> Path:
    """Writes the model dir and returns its path.

    Idempotent: if out_dir already holds a complete build with the same size/seed/arch, it returns
    at once without rebuilding.

    Why idempotent: tests, benchmarks and CI call this on every run (see `write_build`).
    """
    out_dir = Path(out_dir).expanduser().resolve()
    config = _model_config(size, seed, arch, ends_after, context_window)

    def write_payload(out: Path) -> None:
        t0 = time.perf_counter()
        tokenizer_json = train_tokenizer_json(config["vocab_size"])
        weights = _random_weights(config, seed)
        if ends_after is not None:
            make_it_end(weights, config, chain_tokens(tokenizer_json, ends_after), config["eos_token_id"], seed)
        n_params = save_weights(out, weights)
        logger.info("wrote %s weights (%.1fM params) in %.1fs", size, n_params / 1e6, time.perf_counter() - t0)
        atomic_write_bytes(out / "tokenizer.json", tokenizer_json.encode())
        atomic_write_json(out / "tokenizer_config.json",
                           tokenizer_config(config["vocab_size"], config["max_position_embeddings"]))
        atomic_write_json(out / "special_tokens_map.json", special_tokens_map())
        atomic_write_json(out / "generation_config.json", _generation_config(config))
        atomic_write_bytes(out / "README.md", _readme(config, n_params).encode())

    t0 = time.perf_counter()
    if write_build(out_dir, config, PAYLOAD_FILES, write_payload):
        logger.info("built %s/%s seed=%d in %s (%.1fs)", arch, size, seed, out_dir, time.perf_counter() - t0)
    else:
        logger.info("reusing existing build in %s", out_dir)
    return out_dir


def derive_model(src: str | Path, dst: str | Path, chat_template: str | None = None,
                 bos_token: str | None = None) -> Path:
    """A copy of a built model (weights hard-linked) with another chat template, or a tokenizer adding a BOS.

    Tests use it for model variants that differ only in their template (a thinking model) or in
    what `add_special_tokens` adds (`bos_token`: one of the added tokens, put before every encoding),
    without building (or storing) a second set of weights.
    """
    src, dst = Path(src).resolve(), Path(dst).expanduser().resolve()
    dst.mkdir(parents=True, exist_ok=True)
    rewritten = {"tokenizer_config.json"} | ({"tokenizer.json"} if bos_token else set())
    for path in src.iterdir():
        if path.is_file() and not path.name.startswith(".") and path.name not in rewritten:
            link_or_copy(path, dst / path.name)
    config = read_json(src / "tokenizer_config.json") or {}
    if chat_template is not None:
        config["chat_template"] = chat_template
    if bos_token:
        config["bos_token"] = bos_token
        tokenizer_json = with_bos_token((src / "tokenizer.json").read_text(encoding="utf-8"), bos_token)
        atomic_write_bytes(dst / "tokenizer.json", tokenizer_json.encode())
    atomic_write_json(dst / "tokenizer_config.json", config)
    return dst


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
    parser.add_argument("--ends-after", type=int, metavar="N",
                        help="make the model end every reply after N word tokens (greedy or sampled), for clients "
                             "that wait for the end of a turn (agents); default: never ends, like random weights")
    parser.add_argument("--context-window", type=int, metavar="TOKENS",
                        help="the context window the model advertises (max_position_embeddings; default 32768): "
                             "agents' first prompts run to 40-55k tokens with the tiny tokenizer")
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
    path = build_model(args.out_dir, size=args.size, seed=args.seed, arch=args.arch, ends_after=args.ends_after,
                       context_window=args.context_window)
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
