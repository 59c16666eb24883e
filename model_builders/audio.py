"""Build a tiny random-weight audio-capable model (Gemma 4 layout) that the real ``mlx_vlm.load`` accepts.

Why this exists: `input_audio` chat parts must be tested end to end (front-end -> engine ->
mlx-vlm audio tower -> batched decoding) without network access or multi-gigabyte
checkpoints, through exactly the loader a real audio checkpoint goes through.

Why Gemma 4: of mlx-vlm's audio-capable architectures it is the one whose every part can be
built small and offline. Its audio feature extractor (a USM-style log-mel front end) and its
image/video processors are mlx-vlm's own numpy code, configured from ``processor_config.json``
with no download and no torch; the audio conformer, the vision tower and the text model all
take their sizes from config.json. (Gemma 3n's vision tower is a fixed ~300M-parameter
MobileNet; Phi-4-multimodal and the omni models need LoRA or remote-code processors.) The
number of audio tokens follows the clip's duration (one per 40 ms), so a prompt with audio
visibly grows with the clip.

What it writes (``build_audio_vlm``):

* ``config.json`` for mlx-vlm's ``gemma4`` architecture (``text_config``, ``vision_config``,
  ``audio_config``, the multimodal token ids), marked ``"mlx_engined_random_weights": true``;
* ``model.safetensors``: seeded float32 weights in mlx-vlm's own parameter layout (the module
  tree of ``mlx_vlm.models.gemma4.Model`` names and shapes them), std 1/sqrt(fan_in);
* the byte-level BPE of ``model_builders.text`` (trained offline with ``tokenizers``)
  plus Gemma 4's special tokens (turn, image, audio, video, tool and channel markers), named in
  ``extra_special_tokens`` so the processor finds ``audio_token``, ``boa_token`` and so on;
  and Gemma 4's chat template (it renders audio parts as ``<|audio|>``);
* ``processor_config.json`` for mlx-vlm's ``Gemma4Processor`` (16 kHz, 128 mel bins).

Nothing heavy is imported at module import time.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any

from model_builders.files import (
    BUILD_INFO_KEY,
    MARKER_KEY,
    atomic_write_bytes,
    atomic_write_json,
    save_weights,
    write_build,
)
from model_builders.text import PRESETS
from model_builders.tokenizer import ADDED_TOKENS, train_tokenizer_json

logger = logging.getLogger(__name__)

__all__ = ["build_audio_vlm", "GEMMA4_TOKENS", "main"]

# Bump whenever the bytes written for a given seed change (the idempotency check compares it).
AUDIO_BUILDER_VERSION = 1

# Gemma 4's special tokens, appended after the text tokenizer's vocabulary: (attribute name the
# processor reads, token, special). Specials are dropped by skip_special_tokens; the tool-call
# and channel markers are not, as in the real tokenizer, so output parsers can see them.
GEMMA4_TOKENS: tuple[tuple[str, str, bool], ...] = (
    ("bos_token", "<bos>", True),
    ("eos_token", "<eos>", True),
    ("pad_token", "<pad>", True),
    ("sot_token", "<|turn>", True),
    ("eot_token", "<turn|>", True),
    ("image_token", "<|image|>", True),
    ("boi_token", "<|image>", True),
    ("eoi_token", "<image|>", True),
    ("audio_token", "<|audio|>", True),
    ("boa_token", "<|audio>", True),
    ("eoa_token", "<audio|>", True),
    ("video_token", "<|video|>", True),
    ("think_token", "<|think|>", True),
    ("soc_token", "<|channel>", False),
    ("eoc_token", "<channel|>", False),
    ("std_token", "<|tool>", False),
    ("etd_token", "<tool|>", False),
    ("stc_token", "<|tool_call>", False),
    ("etc_token", "<tool_call|>", False),
    ("str_token", "<|tool_response>", False),
    ("etr_token", "<tool_response|>", False),
    ("escape_token", '<|"|>', False),
)
_CORE_TOKENS = ("bos_token", "eos_token", "pad_token")  # named by their own tokenizer_config keys

# Gemma 4 (-it) chat template as published with the checkpoints' tokenizer (tool declarations,
# thinking channel, image/audio/video parts), verbatim.
GEMMA4_CHAT_TEMPLATE = files("model_builders").joinpath("templates/gemma4_chat.jinja").read_text()

# Shapes of the "tiny" build: the tiny text model of `PRESETS` (2 layers, one sliding and one
# global), a 1-layer vision tower and a 1-block audio conformer, so a request with a short clip
# takes milliseconds on CPU. The audio front end is Gemma 4's (128 mel bins, 10 ms hop), which
# the subsampling convolutions expect.
_TEXT = PRESETS["tiny"]
_HEAD_DIM = _TEXT["hidden_size"] // _TEXT["num_attention_heads"]
_AUDIO = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_act": "silu",
          "subsampling_conv_channels": [8, 4], "conv_kernel_size": 5, "residual_weight": 0.5,
          "attention_chunk_size": 12, "attention_context_left": 13, "attention_context_right": 0,
          "attention_logit_cap": 50.0, "attention_invalid_logits_value": -1e9, "use_clipped_linears": False,
          "rms_norm_eps": 1e-6, "gradient_clipping": 1e10, "output_proj_dims": 32}
_VISION = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
           "patch_size": 16, "pooling_kernel_size": 3, "position_embedding_size": 1024,
           "default_output_length": 70, "rms_norm_eps": 1e-6, "use_clipped_linears": False, "standardize": False}
_MAX_SOFT_TOKENS = 70  # image tokens per image (the smallest budget Gemma 4's processors support)
_AUDIO_MS_PER_TOKEN = 40
_AUDIO_SEQ_LENGTH = 750  # at most 30 s of audio per clip

# Gemma's post-attention / post-feedforward norms bring each sublayer's output to unit RMS before
# it joins the residual stream. With unit scales the token's own embedding then dominates the
# stream and a random model echoes the current token whatever it heard; scale 3 lets attention
# over the audio steer the output (different clips, different greedy answers).
POST_NORM_SCALE = 3.0

_PAYLOAD_FILES = (
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "processor_config.json",
    "chat_template.json",
    "generation_config.json",
    "README.md",
)


def _gemma_token_ids(text_vocab: int) -> dict[str, int]:
    """Token ids of Gemma 4's special tokens, by attribute name (right after the text vocabulary)."""
    return {name: text_vocab + i for i, (name, _, _) in enumerate(GEMMA4_TOKENS)}


def _text_token_ids(text_vocab: int) -> dict[str, int]:
    first = text_vocab - len(ADDED_TOKENS)
    return {content: first + i for i, (content, _) in enumerate(ADDED_TOKENS)}


def _tokenizer_json(text_vocab: int) -> str:
    """`train_tokenizer_json`'s BPE with Gemma 4's special tokens added at the end (ids checked)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(train_tokenizer_json(text_vocab))
    tok.add_special_tokens([AddedToken(content, special=True, normalized=False) for _, content, _ in GEMMA4_TOKENS])
    data = json.loads(tok.to_str())
    # add_special_tokens marks every added token special: restore the intended flags.
    flags = {**dict(ADDED_TOKENS), **{content: special for _, content, special in GEMMA4_TOKENS}}
    for entry in data["added_tokens"]:
        entry["special"] = flags.get(entry["content"], False)
    expected = {content: _gemma_token_ids(text_vocab)[name] for name, content, _ in GEMMA4_TOKENS}
    for entry in data["added_tokens"]:
        if entry["content"] in expected and entry["id"] != expected[entry["content"]]:
            raise RuntimeError(f"{entry['content']} got id {entry['id']}, expected {expected[entry['content']]}")
    return json.dumps(data, ensure_ascii=False, indent=2)


def _tokenizer_config(text_vocab: int, max_len: int) -> dict:
    gemma_ids = _gemma_token_ids(text_vocab)
    decoder = {str(i): (content, special) for (content, special), i in
               zip(ADDED_TOKENS, _text_token_ids(text_vocab).values())}
    decoder.update({str(gemma_ids[name]): (content, special) for name, content, special in GEMMA4_TOKENS})
    tokens = {name: content for name, content, _ in GEMMA4_TOKENS}
    return {
        "add_bos_token": False,  # the chat template writes <bos>
        "add_prefix_space": False,
        "added_tokens_decoder": {
            i: {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": special}
            for i, (content, special) in decoder.items()
        },
        **{name: tokens[name] for name in _CORE_TOKENS},
        # Gemma 4's named markers: transformers exposes each as tokenizer.<name> and <name>_id.
        "extra_special_tokens": {name: content for name, content in tokens.items() if name not in _CORE_TOKENS},
        "chat_template": GEMMA4_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_len,
        "padding_side": "left",
        "processor_class": "Gemma4Processor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",  # the BPE's pipeline (see `train_tokenizer_json`)
        "unk_token": None,
    }


def _special_tokens_map() -> dict:
    def tok(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    tokens = {name: content for name, content, _ in GEMMA4_TOKENS}
    return {name: tok(tokens[name]) for name in _CORE_TOKENS}


def _processor_config() -> dict:
    return {
        "processor_class": "Gemma4Processor",
        "audio_ms_per_token": _AUDIO_MS_PER_TOKEN,
        "audio_seq_length": _AUDIO_SEQ_LENGTH,
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "patch_size": _VISION["patch_size"],
                            "max_soft_tokens": _MAX_SOFT_TOKENS, "pooling_kernel_size": _VISION["pooling_kernel_size"],
                            "do_resize": True, "do_rescale": True, "do_normalize": False},
        "feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": 128,
                              "sampling_rate": 16000, "frame_length_ms": 20.0, "hop_length_ms": 10.0},
        "video_processor": {"video_processor_type": "Gemma4VideoProcessor", "max_soft_tokens": _MAX_SOFT_TOKENS,
                            "patch_size": _VISION["patch_size"],
                            "pooling_kernel_size": _VISION["pooling_kernel_size"]},
    }


def _model_config(seed: int) -> dict:
    """The full config.json (minus the file manifest); also the idempotency key."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    text_vocab = _TEXT["vocab_size"]
    ids = _gemma_token_ids(text_vocab)
    vocab = text_vocab + len(GEMMA4_TOKENS)
    text_config = {
        "model_type": "gemma4_text",
        "hidden_size": _TEXT["hidden_size"],
        "num_hidden_layers": _TEXT["num_hidden_layers"],
        "intermediate_size": _TEXT["intermediate_size"],
        "num_attention_heads": _TEXT["num_attention_heads"],
        "num_key_value_heads": _TEXT["num_key_value_heads"],
        "head_dim": _HEAD_DIM,
        "global_head_dim": _HEAD_DIM,
        "rms_norm_eps": _TEXT["rms_norm_eps"],
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "hidden_size_per_layer_input": 0,  # no per-layer input embeddings (a 2B/4B-only feature)
        "num_kv_shared_layers": 0,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4096,
        "max_position_embeddings": _TEXT["max_position_embeddings"],
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "attention_k_eq_v": False,
        "tie_word_embeddings": True,
        "pad_token_id": ids["pad_token"],
        "bos_token_id": ids["bos_token"],
        "eos_token_id": [ids["eos_token"], ids["eot_token"]],
    }
    config: dict[str, Any] = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text_config,
        "vision_config": copy.deepcopy(_VISION),
        "audio_config": copy.deepcopy(_AUDIO),
        "vocab_size": vocab,
        "hidden_size": _TEXT["hidden_size"],
        "image_token_id": ids["image_token"],
        "audio_token_id": ids["audio_token"],
        "video_token_id": ids["video_token"],
        "boi_token_id": ids["boi_token"],
        "eoi_token_id": ids["eoi_token"],
        "boa_token_id": ids["boa_token"],
        "eoa_token_id": ids["eoa_token"],
        "vision_soft_tokens_per_image": _MAX_SOFT_TOKENS,
        "audio_ms_per_token": _AUDIO_MS_PER_TOKEN,
        "pad_token_id": ids["pad_token"],
        "bos_token_id": ids["bos_token"],
        "eos_token_id": [ids["eos_token"], ids["eot_token"]],
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        MARKER_KEY: True,
        BUILD_INFO_KEY: {
            "builder": "audio_builder",
            "builder_version": AUDIO_BUILDER_VERSION,
            "size": "tiny",
            "seed": seed,
            "arch": "gemma4",
            "note": "RANDOM WEIGHTS, NOT A TRAINED MODEL. Built by model_builders.audio.",
        },
    }
    return dict(sorted(config.items()))


def _generation_config(config: dict) -> dict:
    # Greedy by default: tests compare the server's output with mlx_vlm.generate token for token.
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"], "do_sample": False}


def _mlx_vlm_model(config: dict):
    """Instantiates mlx-vlm's model class for ``config`` exactly as ``mlx_vlm.load`` would."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = copy.deepcopy(config)
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, ["text", "vision", "audio"])
    return module.Model(model_config)


def _random_weights(config: dict, seed: int) -> dict:
    """Seeded weights keyed by the names mlx-vlm's strict ``load_weights`` checks.

    The module tree of the mlx-vlm class names and shapes every tensor, so the layout can
    never drift from what the loader wants. std = 1/sqrt(fan_in) (a conv's fan-in is its whole
    kernel volume), 1-D parameters (norm scales) 1 (post-sublayer norms
    POST_NORM_SCALE), biases 0, residual projections scaled by
    1/sqrt(2 * layers): logits with unit spread, neither flat nor exploding.
    """
    import math

    import mlx.core as mx
    from mlx.utils import tree_flatten

    model = _mlx_vlm_model(config)
    shapes = dict(tree_flatten(model.parameters()))
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(seed), len(names))
    text_scale = 1.0 / (2 * config["text_config"]["num_hidden_layers"]) ** 0.5
    weights = {}
    for i, name in enumerate(names):
        shape = shapes[name].shape
        if name.endswith(".bias"):
            weights[name] = mx.zeros(shape, dtype=mx.float32)
        elif len(shape) <= 1:
            scale = POST_NORM_SCALE if name.startswith("language_model.") and ".post_" in name else 1.0
            weights[name] = mx.full(shape, scale, dtype=mx.float32)  # norm scales and per-layer scalars
        else:
            std = math.prod(shape[1:]) ** -0.5 if len(shape) > 2 else shape[-1] ** -0.5
            if name.startswith("language_model.") and name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= text_scale
            weights[name] = mx.random.normal(shape, dtype=mx.float32, key=keys[i]) * std
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    return weights


def _readme(config: dict, n_params: int) -> str:
    info = config[BUILD_INFO_KEY]
    text = config["text_config"]
    return f"""# RANDOM WEIGHTS - NOT A TRAINED MODEL

Generated by `model_builders.audio` (mlx-engined) for tests. **Its weights are random
noise**: it "transcribes" audio with gibberish. Do not evaluate or serve it as a model.

| field | value |
|---|---|
| architecture | `gemma4` (mlx-vlm), with audio and vision towers |
| seed | `{info['seed']}` |
| parameters | {n_params:,} (float32) |
| text hidden / layers / heads | {text['hidden_size']} / {text['num_hidden_layers']} / {text['num_attention_heads']} |
| audio hidden / layers | {config['audio_config']['hidden_size']} / {config['audio_config']['num_hidden_layers']} |
| audio | 16 kHz, one token per {_AUDIO_MS_PER_TOKEN} ms |

Rebuild with:

    python -m model_builders.audio OUT_DIR --seed {info['seed']}
"""


def build_audio_vlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Writes the model directory and returns its path (idempotent, like ``build_model``).

    A directory that already holds a complete build of the same seed and builder version
    is returned as is; a config.json not written by a builder is never overwritten.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    config = _model_config(seed)

    def write_payload(out: Path) -> None:
        n_params = save_weights(out, _random_weights(config, seed))
        text_vocab = _TEXT["vocab_size"]
        atomic_write_bytes(out / "tokenizer.json", _tokenizer_json(text_vocab).encode())
        atomic_write_json(out / "tokenizer_config.json",
                           _tokenizer_config(text_vocab, _TEXT["max_position_embeddings"]))
        atomic_write_json(out / "special_tokens_map.json", _special_tokens_map())
        atomic_write_json(out / "processor_config.json", _processor_config())
        atomic_write_json(out / "chat_template.json", {"chat_template": GEMMA4_CHAT_TEMPLATE})
        atomic_write_json(out / "generation_config.json", _generation_config(config))
        atomic_write_bytes(out / "README.md", _readme(config, n_params).encode())
        logger.info("built gemma4 (audio) seed=%d (%.2fM params) in %s", seed, n_params / 1e6, out)

    if not write_build(out_dir, config, _PAYLOAD_FILES, write_payload):
        logger.info("reusing existing audio model build in %s", out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="engined-build-audio-vlm",
        description="Build a tiny random-weight audio-capable Gemma 4 model (mlx-vlm layout) for tests.")
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = build_audio_vlm(args.out_dir, seed=args.seed)
    except (ValueError, FileExistsError) as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
