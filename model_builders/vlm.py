"""Build a tiny random-weight vision-language model that the real ``mlx_vlm.load`` accepts.

Why this exists: the engine's vision path (mlx-vlm model, processor, chat template with
image markers, continuous batching of image requests) must be tested end to end without
network access or multi-gigabyte checkpoints, through exactly the loader a real Qwen2-VL
checkpoint goes through.

What it writes (``build_vlm``), in the layout of a Qwen2-VL-Instruct checkpoint:

* ``config.json`` for mlx-vlm's ``qwen2_vl`` architecture (text fields at the root, a
  ``vision_config``, mRoPE sections, image/video/vision-start token ids), marked with
  ``"mlx_engined_random_weights": true``;
* ``model.safetensors``: seeded float32 weights in mlx-vlm's own parameter layout (the
  module tree of ``mlx_vlm.models.qwen2_vl.Model`` names and shapes them), std 1/sqrt(fan_in);
* the byte-level BPE of ``model_builders.text`` (trained offline with ``tokenizers``)
  plus Qwen2-VL's vision tokens (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
  ``<|video_pad|>``), and Qwen2-VL-Instruct's real chat template (it renders image parts as
  ``<|vision_start|><|image_pad|><|vision_end|>``);
* ``preprocessor_config.json`` for mlx-vlm's torch-free Qwen2-VL image processor. Size ``tiny``
  (tests) has a small pixel budget (56x56 to 112x112 pixels: 4 to 16 image tokens) and a 2-block
  vision tower, so a request takes milliseconds on CPU; ``bench`` (72M parameters, up to 448x448
  pixels: 256 image tokens) makes encoding an image cost what it costs in practice.

Dynamic resolution is why Qwen2-VL was picked: the number of image tokens follows the image
size, so per-request ``resize_shape`` visibly changes the prompt. Nothing heavy is imported
at module import time.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from pathlib import Path
from typing import Any

from model_builders.ending import chain_tokens, make_it_end
from model_builders.files import (
    BUILD_INFO_KEY,
    MARKER_KEY,
    atomic_write_bytes,
    atomic_write_json,
    save_weights,
    write_build,
)
from model_builders.text import PRESETS
from model_builders.tokenizer import ADDED_TOKENS, ENDOFTEXT, IM_END, IM_START, train_tokenizer_json

logger = logging.getLogger(__name__)

__all__ = ["build_vlm", "VISION_TOKENS", "main"]

# Bump whenever the bytes written for a given seed change (the idempotency check compares it).
VLM_BUILDER_VERSION = 1

# Qwen2-VL's multimodal markers, appended after the text tokenizer's vocabulary (as Qwen does).
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# Qwen2-VL-2B/7B-Instruct's chat_template, verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_PATCHES = {"patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "in_channels": 3}
# Shapes per size. "tiny" (tests): the tiny text model (`PRESETS`), a 2-block vision tower and a
# 56x56..112x112 pixel budget (in 28-pixel steps: 4 to 16 image tokens after the 2x2 merge), so a
# request takes milliseconds on CPU. "bench" (benchmarks): a vision tower and pixel budget big
# enough (up to 448x448: 256 image tokens) that encoding an image costs what it costs in practice.
# mlp_ratio is an int: transformers validates Qwen2-VL configs strictly.
VLM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "text": PRESETS["tiny"],
        "vision": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, **_PATCHES},
        "min_pixels": 56 * 56,
        "max_pixels": 112 * 112,
    },
    "bench": {
        "text": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
                 "intermediate_size": 1536, "vocab_size": 8192, "max_position_embeddings": 32768,
                 "rms_norm_eps": 1e-6},
        "vision": {"depth": 12, "embed_dim": 512, "num_heads": 8, "mlp_ratio": 4, **_PATCHES},
        "min_pixels": 56 * 56,
        "max_pixels": 448 * 448,
    },
}

_PAYLOAD_FILES = (
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "preprocessor_config.json",
    "chat_template.json",
    "generation_config.json",
    "README.md",
)


def _vision_token_ids(text_vocab: int) -> dict[str, int]:
    return {content: text_vocab + i for i, content in enumerate(VISION_TOKENS)}


def _text_token_ids(text_vocab: int) -> dict[str, int]:
    first = text_vocab - len(ADDED_TOKENS)
    return {content: first + i for i, (content, _) in enumerate(ADDED_TOKENS)}


def _tokenizer_json(text_vocab: int) -> str:
    """`train_tokenizer_json`'s BPE with Qwen2-VL's vision markers added as special tokens at the end."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(train_tokenizer_json(text_vocab))
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in VISION_TOKENS])
    data = json.loads(tok.to_str())
    # add_special_tokens marks every added token special: keep `ADDED_TOKENS`' flags for the rest.
    flags = {**dict(ADDED_TOKENS), **{c: True for c in VISION_TOKENS}}
    for entry in data["added_tokens"]:
        entry["special"] = flags.get(entry["content"], False)
    ids = _vision_token_ids(text_vocab)
    for entry in data["added_tokens"]:
        if entry["content"] in ids and entry["id"] != ids[entry["content"]]:
            raise RuntimeError(f"{entry['content']} got id {entry['id']}, expected {ids[entry['content']]}")
    return json.dumps(data, ensure_ascii=False, indent=2)


def _tokenizer_config(text_vocab: int, max_len: int) -> dict:
    ids = {**_text_token_ids(text_vocab), **_vision_token_ids(text_vocab)}
    flags = {**dict(ADDED_TOKENS), **{c: True for c in VISION_TOKENS}}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": flags[content]}
            for content in ids
        },
        "additional_special_tokens": [IM_START, IM_END, *VISION_TOKENS],
        "bos_token": None,
        "chat_template": QWEN2_VL_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": ENDOFTEXT,
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _special_tokens_map() -> dict:
    def tok(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    return {"additional_special_tokens": [IM_START, IM_END, *VISION_TOKENS], "eos_token": tok(IM_END),
            "pad_token": tok(ENDOFTEXT)}


def _preprocessor_config(size: str) -> dict:
    preset = VLM_PRESETS[size]
    vision = preset["vision"]
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "max_pixels": preset["max_pixels"],
        "merge_size": vision["spatial_merge_size"],
        "min_pixels": preset["min_pixels"],
        "patch_size": vision["patch_size"],
        "processor_class": "Qwen2VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "temporal_patch_size": vision["temporal_patch_size"],
    }


def _model_config(size: str, seed: int, ends_after: int | None = None, context_window: int | None = None) -> dict:
    """The full config.json (minus the file manifest); also the idempotency key."""
    if size not in VLM_PRESETS:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(VLM_PRESETS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    text = VLM_PRESETS[size]["text"]
    vision = VLM_PRESETS[size]["vision"]
    text_vocab = text["vocab_size"]
    text_ids = _text_token_ids(text_vocab)
    vision_ids = _vision_token_ids(text_vocab)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # mRoPE splits the rotary half-dimension into (temporal, height, width) sections (16/24/24 of 64 in Qwen2-VL).
    half = head_dim // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    config: dict[str, Any] = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": section},
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        **copy.deepcopy(text),
        "vocab_size": text_vocab + len(VISION_TOKENS),
        "vision_config": {**vision, "model_type": "qwen2_vl", "hidden_size": text["hidden_size"],
                          "in_chans": vision["in_channels"]},
        "image_token_id": vision_ids[IMAGE_PAD],
        "video_token_id": vision_ids[VIDEO_PAD],
        "vision_start_token_id": vision_ids[VISION_START],
        "vision_end_token_id": vision_ids[VISION_END],
        "bos_token_id": text_ids[ENDOFTEXT],
        "eos_token_id": text_ids[IM_END],
        "pad_token_id": text_ids[ENDOFTEXT],
        "torch_dtype": "float32",
        "use_cache": True,
        MARKER_KEY: True,
        BUILD_INFO_KEY: {
            "builder": "vlm_builder",
            "builder_version": VLM_BUILDER_VERSION,
            "size": size,
            "seed": seed,
            "arch": "qwen2_vl",
            "note": "RANDOM WEIGHTS, NOT A TRAINED MODEL. Built by model_builders.vlm.",
        },
    }
    if ends_after is not None:  # replies end after `ends_after` words (`model_builders.ending`): an untied output
        if isinstance(ends_after, bool) or not isinstance(ends_after, int) or not 1 <= ends_after < 48:
            raise ValueError(f"ends_after must be an int in 1..47, got {ends_after!r}")
        config["tie_word_embeddings"] = False
        config[BUILD_INFO_KEY]["ends_after"] = ends_after
    if context_window is not None:  # mRoPE has no position table: only the advertised window changes
        if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 256:
            raise ValueError(f"context_window must be an int >= 256, got {context_window!r}")
        config["max_position_embeddings"] = context_window
    return dict(sorted(config.items()))


def _make_language_model_end(weights: dict, config: dict, tokenizer_json: str, ends_after: int, seed: int) -> None:
    """`model_builders.ending.make_it_end` applied to the VLM's language model (its weights under `language_model.`)."""
    prefix = "language_model."
    text = {name[len(prefix):]: w for name, w in weights.items() if name.startswith(prefix)}
    end_token = next(t["id"] for t in json.loads(tokenizer_json)["added_tokens"] if t["content"] == IM_END)
    make_it_end(text, config, chain_tokens(tokenizer_json, ends_after), end_token, seed)
    weights.update({prefix + name: w for name, w in text.items()})


def _generation_config(config: dict) -> dict:
    ids = _text_token_ids(config["vocab_size"] - len(VISION_TOKENS))
    # Greedy by default: a random-weight model has nothing to gain from sampling, and tests
    # compare the server's output with mlx_vlm.generate token for token.
    return {"bos_token_id": ids[ENDOFTEXT], "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[ENDOFTEXT], "do_sample": False}


def _mlx_vlm_model(config: dict):
    """Instantiates mlx-vlm's model class for ``config`` exactly as ``mlx_vlm.load`` would."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = copy.deepcopy(config)
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, ["text", "vision"])
    return module.Model(model_config)


def _random_weights(config: dict, seed: int) -> dict:
    """Seeded weights keyed by the names mlx-vlm's strict ``load_weights`` checks.

    The module tree of the mlx-vlm class names and shapes every tensor, so the layout can
    never drift from what the loader wants. std = 1/sqrt(fan_in) (a conv's fan-in is its
    whole kernel volume), norms 1, biases 0, residual projections scaled by
    1/sqrt(2 * layers), as in `model_builders.text`: logits with unit spread, neither flat nor exploding.
    """
    import math

    import mlx.core as mx
    from mlx.utils import tree_flatten

    model = _mlx_vlm_model(config)
    shapes = dict(tree_flatten(model.parameters()))
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(seed), len(names))
    text_scale = 1.0 / (2 * config["num_hidden_layers"]) ** 0.5
    vision_scale = 1.0 / (2 * config["vision_config"]["depth"]) ** 0.5
    weights = {}
    for i, name in enumerate(names):
        shape = shapes[name].shape
        if name.endswith(".bias"):
            weights[name] = mx.zeros(shape, dtype=mx.float32)
        elif len(shape) == 1:
            weights[name] = mx.ones(shape, dtype=mx.float32)  # RMSNorm / LayerNorm scales
        else:
            # Linear (out, in) and embeddings: fan-in is the last dim; a conv (out, t, h, w, in) its kernel volume.
            std = math.prod(shape[1:]) ** -0.5 if len(shape) > 2 else shape[-1] ** -0.5
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= text_scale
            elif name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
                std *= vision_scale
            weights[name] = mx.random.normal(shape, dtype=mx.float32, key=keys[i]) * std
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    return weights


def _readme(config: dict, n_params: int) -> str:
    info = config[BUILD_INFO_KEY]
    preset = VLM_PRESETS[info["size"]]
    return f"""# RANDOM WEIGHTS - NOT A TRAINED MODEL

Generated by `model_builders.vlm` (mlx-engined) for tests and benchmarks. **Its weights
are random noise**: it "describes" images with gibberish. Do not evaluate or serve it as a model.

| field | value |
|---|---|
| architecture | `qwen2_vl` (mlx-vlm) |
| size preset / seed | `{info['size']}` / `{info['seed']}` |
| parameters | {n_params:,} (float32) |
| text hidden / layers / heads | {config['hidden_size']} / {config['num_hidden_layers']} / {config['num_attention_heads']} |
| vision embed / depth / patch | {config['vision_config']['embed_dim']} / {config['vision_config']['depth']} / {config['vision_config']['patch_size']} |
| image pixels | {preset['min_pixels']} to {preset['max_pixels']} |

Rebuild with:

    python -m model_builders.vlm OUT_DIR --size {info['size']} --seed {info['seed']}
"""


def build_vlm(out_dir: str | Path, size: str = "tiny", seed: int = 0, ends_after: int | None = None,
              context_window: int | None = None) -> Path:
    """Writes the model directory and returns its path (idempotent, like ``build_model``).

    A directory that already holds a complete build of the same seed and builder version
    is returned as is; a config.json not written by a builder is never overwritten.
    `ends_after` and `context_window` mean what they mean for `model_builders.text.build_model`.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    config = _model_config(size, seed, ends_after, context_window)

    def write_payload(out: Path) -> None:
        text_vocab = VLM_PRESETS[size]["text"]["vocab_size"]
        tokenizer_json = _tokenizer_json(text_vocab)
        weights = _random_weights(config, seed)
        if ends_after is not None:
            _make_language_model_end(weights, config, tokenizer_json, ends_after, seed)
        n_params = save_weights(out, weights)
        atomic_write_bytes(out / "tokenizer.json", tokenizer_json.encode())
        atomic_write_json(out / "tokenizer_config.json",
                           _tokenizer_config(text_vocab, config["max_position_embeddings"]))
        atomic_write_json(out / "special_tokens_map.json", _special_tokens_map())
        atomic_write_json(out / "preprocessor_config.json", _preprocessor_config(size))
        atomic_write_json(out / "chat_template.json", {"chat_template": QWEN2_VL_CHAT_TEMPLATE})
        atomic_write_json(out / "generation_config.json", _generation_config(config))
        atomic_write_bytes(out / "README.md", _readme(config, n_params).encode())
        logger.info("built qwen2_vl %s seed=%d (%.2fM params) in %s", size, seed, n_params / 1e6, out)

    if not write_build(out_dir, config, _PAYLOAD_FILES, write_payload):
        logger.info("reusing existing VLM build in %s", out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="engined-build-vlm",
        description="Build a tiny random-weight Qwen2-VL model (mlx-vlm layout) for tests and benchmarks.")
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--size", choices=sorted(VLM_PRESETS), default="tiny",
                        help="tiny (tests) or bench (benchmarks) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    parser.add_argument("--ends-after", type=int, metavar="N",
                        help="end every reply after N word tokens (as engined-build-model --ends-after)")
    parser.add_argument("--context-window", type=int, metavar="TOKENS",
                        help="the context window the model advertises (default 32768)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = build_vlm(args.out_dir, size=args.size, seed=args.seed, ends_after=args.ends_after,
                         context_window=args.context_window)
    except (ValueError, FileExistsError) as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
