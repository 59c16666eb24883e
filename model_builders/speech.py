"""Build tiny random-weight speech models that mlx-audio's real loaders accept: a Whisper and a Soprano TTS.

Why this exists: `/v1/audio/transcriptions`, `/translations` and `/speech` must be tested end to
end (openai SDK -> front-end -> engine -> mlx-audio) without network access or real checkpoints,
through exactly the loaders a real checkpoint goes through (`mlx_audio.stt.utils.load`,
`mlx_audio.tts.utils.load`).

Whisper (``build_whisper``): mlx-audio's own Whisper (``mlx_audio.stt.models.whisper``) in its MLX
layout (``n_mels``, ``n_audio_ctx``... in config.json), a 1-layer encoder and a 2-layer decoder of
width 32. ``n_audio_ctx`` stays 1500 because the encoder's input is always a 30-s window of 3000 mel
frames. The vocabulary is the multilingual one (51,865 ids, so the model counts as multilingual: 99 language tokens,
translate / transcribe, timestamps) with Whisper's special tokens at Whisper's ids; the text part
is a byte-level BPE trained offline on the corpus of ``model_builders.tokenizer`` and padded with
pronounceable pseudo-words (so whatever a random model emits decodes to readable text). The
tokenizer and feature extractor load through transformers' ``WhisperProcessor`` (mlx-audio's
``post_load_hook``), from ``tokenizer.json`` and ``preprocessor_config.json``: nothing downloads.

TTS (``build_tts``): mlx-audio's Soprano (``mlx_audio.tts.models.soprano``): a Qwen3 language model
whose hidden states a Vocos decoder (ConvNeXt + ISTFT head) turns into 32 kHz audio. Of mlx-audio's
TTS architectures it is the one that is complete in one directory: its text front end is plain
Python (number and abbreviation expansion, no phonemizer), its tokenizer is a local
``tokenizer.json`` and its codec is its own decoder, in the same safetensors (Kokoro needs misaki
and spaCy models, Qwen3-TTS / Breeze / Echo / OuteTTS a separate codec checkpoint, Kitten onnx and
espeak data, Spark / Dia / CSM more downloads). The decoder sizes follow mlx-audio's rule for a
path that does not name "soprano-1.1" (8 ConvNeXt layers 512 wide, input kernel 3): config.json
cannot set them (mlx-audio's config takes no nested decoder config), so the decoder is full size
(~13M parameters) while the language model is tiny.

Weights are seeded: the same seed writes the same bytes. Nothing heavy is imported at module
import time.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import sys
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
from model_builders.tokenizer import _CODAS, _ONSETS, _VOWELS, _generate_corpus

logger = logging.getLogger(__name__)

__all__ = ["build_whisper", "build_tts", "WHISPER_LANGUAGES", "main_whisper", "main_tts"]

# Bump whenever the bytes written for a given seed change (the idempotency check compares it).
SPEECH_BUILDER_VERSION = 2

# Whisper's multilingual vocabulary: 50,257 text ids, then the special tokens below.
WHISPER_TEXT_VOCAB = 50_257
# The 99 languages of the multilingual Whisper checkpoints (large-v3 adds "yue" as the 100th), in id order.
WHISPER_LANGUAGES: tuple[str, ...] = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la "
    "mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be "
    "tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su"
).split()
_WHISPER_TASK_TOKENS = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                        "<|notimestamps|>")
_N_TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>
_BPE_SIZE = 8_000  # trained merges; the rest of the 50,257 text ids are pseudo-words
_EMBEDDING_SCALE = 4.0

# n_text_ctx 64 (448 in real checkpoints): a window decodes at most 32 tokens, so a random model's
# transcript, which Whisper's temperature fallback retries up to six times, stays cheap in tests.
# The encoder always reads 1,500 positions, and mlx-audio runs Whisper in float16 (slow on CPU): one layer
# of width 32 keeps a window's encoding near 0.2 s here.
WHISPER_DIMS = {"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 32, "n_audio_head": 1, "n_audio_layer": 1,
                "n_text_ctx": 64, "n_text_state": 32, "n_text_head": 2, "n_text_layer": 2}

_WHISPER_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "preprocessor_config.json", "README.md")

# Soprano: a Qwen3 LM (hidden states -> Vocos decoder). Token strings of its prompt format.
SOPRANO_TOKENS = ("[STOP]", "[TEXT]", "[START]")
TTS_VOCAB = 2_048
TTS_SAMPLE_RATE = 32_000
TTS_TOKEN_SAMPLES = 2_048  # audio samples per generated token (the decoder's token_size)
_TTS_LM = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 2048, "tie_word_embeddings": False}
_TTS_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "README.md")


# --------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------

def whisper_special_tokens() -> list[str]:
    """Whisper's special tokens in id order, starting at id 50,257."""
    return (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{code}|>" for code in WHISPER_LANGUAGES]
            + list(_WHISPER_TASK_TOKENS) + [f"<|{i * 0.02:.2f}|>" for i in range(_N_TIMESTAMPS)])


def _train_bpe(bpe_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (GPT-2 pre-tokenizer, as Whisper's) trained on the builders' offline corpus."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    trainee = Tokenizer(BPE())
    trainee.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainee.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainee.train_from_iterator(_generate_corpus(max(200_000, 100 * bpe_size)), trainer=trainer)
    trained = json.loads(trainee.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in trained["merges"]]
    return dict(trained["vocab"]), merges


def _pad_with_pseudo_words(vocab: dict[str, int], size: int, seed: int) -> None:
    """Fills ``vocab`` up to ``size`` ids with new space-prefixed pseudo-words (byte-level strings).

    They have no merges, so encoding never produces them, but every id a random model emits
    decodes to a readable word rather than to a placeholder.
    """
    rng = random.Random(seed)
    while len(vocab) < size:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.choice((1, 2, 2, 3))))
        token = "\u0120" + word  # "Ġ": the byte-level form of a leading space
        if token not in vocab:
            vocab[token] = len(vocab)


def _byte_level_tokenizer_json(vocab: dict[str, int], merges: list[tuple[str, str]],
                               specials: list[tuple[str, bool]]) -> str:
    """tokenizer.json of a byte-level BPE whose added tokens take the ids right after ``vocab``."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(content, special=True, normalized=False) for content, _ in specials])
    data = json.loads(tok.to_str())
    flags = dict(specials)
    for entry in data["added_tokens"]:
        entry["special"] = flags.get(entry["content"], True)
    expected = len(vocab) + len(specials)
    if tok.get_vocab_size(with_added_tokens=True) != expected:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, expected {expected}")
    return json.dumps(data, ensure_ascii=False)


def _whisper_tokenizer_json(seed: int) -> str:
    vocab, merges = _train_bpe(_BPE_SIZE)
    _pad_with_pseudo_words(vocab, WHISPER_TEXT_VOCAB, seed)
    return _byte_level_tokenizer_json(vocab, merges, [(t, True) for t in whisper_special_tokens()])


def _special_map(bos: str, eos: str, unk: str | None, pad: str) -> dict[str, Any]:
    out = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    if unk is not None:
        out["unk_token"] = unk
    return out


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------

def _random_parameters(module: Any, seed: int) -> dict[str, Any]:
    """Seeded float32 parameters named and shaped by the module tree itself.

    Matrices and convolutions get std 1/sqrt(fan_in); vectors (norm scales, biases) keep the
    module's own initial values (build the module after ``mx.random.seed(seed)``). The loaders'
    ``sanitize`` leaves keys in the MLX layout unchanged, so the module's own names are exactly
    what a converted checkpoint holds.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(module.parameters())) + 1)
    weights: dict[str, Any] = {}
    for i, (name, value) in enumerate(sorted(tree_flatten(module.parameters()))):
        if value.ndim < 2:
            tensor = value
        else:
            fan_in = 1
            for d in value.shape[1:]:
                fan_in *= d
            tensor = mx.random.normal(tuple(value.shape), key=keys[i]) * (1.0 / fan_in ** 0.5)
        weights[name] = tensor.astype(mx.float32)
    mx.eval(weights)
    return weights


def _model_card(title: str, config: dict) -> str:
    return (f"# {title}\n\nRandom weights (seed {config[BUILD_INFO_KEY]['seed']}), built by mlx-engined's "
            f"`model_builders.speech` for tests. It produces noise, not speech or transcripts.\n")


# --------------------------------------------------------------------------------------
# Whisper
# --------------------------------------------------------------------------------------

def _whisper_config(seed: int) -> dict:
    n_vocab = WHISPER_TEXT_VOCAB + len(whisper_special_tokens())
    return {"model_type": "whisper", **WHISPER_DIMS, "n_vocab": n_vocab, MARKER_KEY: True,
            BUILD_INFO_KEY: {"builder": "whisper", "version": SPEECH_BUILDER_VERSION, "seed": seed}}


def build_whisper(out_dir: str | Path, seed: int = 0) -> Path:
    """Writes a tiny random-weight Whisper loadable by ``mlx_audio.stt.utils.load``; idempotent per seed."""
    out = Path(out_dir)
    config = _whisper_config(seed)

    def write_payload(target: Path) -> None:
        import mlx.core as mx
        from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

        mx.random.seed(seed)
        dims = ModelDimensions.from_dict(config)
        model = Model(dims, dtype=mx.float32)
        weights = _random_parameters(model, seed)
        # Peakier logits: with std-1 logits the 1,501 timestamp tokens' summed probability always beats
        # the best text token, so Whisper's timestamp rules force timestamp after timestamp until
        # nothing is allowed (NaN log-probs, "!" ids). Four times wider embeddings let text win.
        weights["decoder.token_embedding.weight"] = weights["decoder.token_embedding.weight"] * _EMBEDDING_SCALE
        n_params = save_weights(target, weights)
        atomic_write_bytes(target / "tokenizer.json", _whisper_tokenizer_json(seed).encode())
        eot = "<|endoftext|>"
        atomic_write_json(target / "tokenizer_config.json", {
            "tokenizer_class": "WhisperTokenizer", "model_max_length": 1024, "errors": "replace",
            "add_prefix_space": False, "clean_up_tokenization_spaces": False, "processor_class": "WhisperProcessor",
            **_special_map(eot, eot, eot, eot)})
        atomic_write_json(target / "special_tokens_map.json", _special_map(eot, eot, eot, eot))
        atomic_write_json(target / "preprocessor_config.json", {
            "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "WhisperProcessor",
            "feature_size": WHISPER_DIMS["n_mels"], "sampling_rate": 16_000, "hop_length": 160,
            "chunk_length": 30, "n_fft": 400, "n_samples": 480_000, "nb_max_frames": 3000,
            "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False})
        atomic_write_bytes(target / "README.md", _model_card("Tiny random Whisper", config).encode())
        logger.info("whisper: %d parameters written to %s", n_params, target)

    if write_build(out, copy.deepcopy(config), _WHISPER_FILES, write_payload):
        logger.info("built %s", out)
    return out


# --------------------------------------------------------------------------------------
# Soprano TTS
# --------------------------------------------------------------------------------------

def _tts_config(seed: int) -> dict:
    return {"model_type": "soprano", "architectures": ["Qwen3ForCausalLM"], **_TTS_LM, "vocab_size": TTS_VOCAB,
            "sample_rate": TTS_SAMPLE_RATE, MARKER_KEY: True,
            BUILD_INFO_KEY: {"builder": "tts", "version": SPEECH_BUILDER_VERSION, "seed": seed}}


def _tts_tokenizer_json() -> str:
    specials = [("<|endoftext|>", True), *((t, True) for t in SOPRANO_TOKENS)]
    vocab, merges = _train_bpe(TTS_VOCAB - len(specials))
    _pad_with_pseudo_words(vocab, TTS_VOCAB - len(specials), 0)
    return _byte_level_tokenizer_json(vocab, merges, specials)


def build_tts(out_dir: str | Path, seed: int = 0) -> Path:
    """Writes a tiny random-weight Soprano TTS loadable by ``mlx_audio.tts.utils.load``; idempotent per seed."""
    out = Path(out_dir)
    config = _tts_config(seed)

    def write_payload(target: Path) -> None:
        import mlx.core as mx
        from mlx_audio.tts.models.soprano.soprano import Model, ModelConfig

        mx.random.seed(seed)
        model_config = ModelConfig.from_dict({**config, "model_path": str(target)})
        model = Model(model_config)
        weights = _random_parameters(model, seed)
        n_params = save_weights(target, weights)
        atomic_write_bytes(target / "tokenizer.json", _tts_tokenizer_json().encode())
        eos = "<|endoftext|>"
        atomic_write_json(target / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
            "clean_up_tokenization_spaces": False, **_special_map(eos, eos, None, "[STOP]")})
        atomic_write_json(target / "special_tokens_map.json", _special_map(eos, eos, None, "[STOP]"))
        atomic_write_bytes(target / "README.md", _model_card("Tiny random Soprano TTS", config).encode())
        logger.info("tts: %d parameters written to %s", n_params, target)

    if write_build(out, copy.deepcopy(config), _TTS_FILES, write_payload):
        logger.info("built %s", out)
    return out


# --------------------------------------------------------------------------------------
# Console scripts
# --------------------------------------------------------------------------------------

def _main(prog: str, description: str, build: Any, argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = build(args.out_dir, seed=args.seed)
    except (ValueError, FileExistsError) as exc:
        parser.error(str(exc))
    print(path)
    return 0


def main_whisper(argv: list[str] | None = None) -> int:
    """`engined-build-whisper OUT_DIR`: a tiny random-weight Whisper for mlx-audio's loader."""
    return _main("engined-build-whisper", "Build a tiny random-weight Whisper (mlx-audio layout) for tests.",
                 build_whisper, argv)


def main_tts(argv: list[str] | None = None) -> int:
    """`engined-build-tts OUT_DIR`: a tiny random-weight Soprano TTS for mlx-audio's loader."""
    return _main("engined-build-tts", "Build a tiny random-weight Soprano TTS (mlx-audio layout) for tests.",
                 build_tts, argv)


if __name__ == "__main__":
    sys.exit(main_whisper())
