"""Random-weight embedding models of real architectures, loadable by the real loaders.

Two kinds, as /v1/embeddings serves them:

* `build_bert_embedding`: a tiny BERT (WordPiece tokenizer, `[CLS] … [SEP]`) that
  `mlx_embeddings.load` loads; it mean-pools and L2-normalizes (`text_embeds`).
* `build_decoder_embedding`: a tiny Qwen3 decoder laid out as Qwen3-Embedding ships: the
  tokenizer appends `<|endoftext|>` to every input and sentence-transformers files
  (`modules.json`, `1_Pooling/config.json` with `pooling_mode_lasttoken`) say how to pool;
  `mlx_lm.load` loads it, and the engine pools the last token's hidden state.

Weights are seeded noise (the same seed gives the same bytes). Never a trained model.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path

from model_builders.files import (
    BUILD_INFO_KEY,
    MARKER_KEY,
    atomic_write_bytes,
    atomic_write_json,
    save_weights,
    write_build,
)
from model_builders.text import _random_weights as decoder_random_weights
from model_builders.tokenizer import ENDOFTEXT, _generate_corpus, special_tokens_map, token_ids, train_tokenizer_json
from model_builders.tokenizer import tokenizer_config as qwen_tokenizer_config

log = logging.getLogger(__name__)

BUILDER_VERSION = 1
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BERT_PAYLOAD = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                "README.md")
DECODER_PAYLOAD = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "modules.json", "config_sentence_transformers.json", "1_Pooling/config.json", "README.md")
README = """# RANDOM WEIGHTS - NOT A TRAINED MODEL

Built by `model_builders.embedding` (mlx-engined) for tests and benchmarks: a {what} whose
weights are seeded noise. Its vectors mean nothing. Rebuild with `engined-build-embedding`.
"""


def _build_info(kind: str, seed: int) -> dict:
    return {MARKER_KEY: True, BUILD_INFO_KEY: {"builder_version": BUILDER_VERSION, "kind": kind, "seed": seed,
                                               "note": "RANDOM WEIGHTS, NOT A TRAINED MODEL."}}


# -- BERT ---------------------------------------------------------------------------------------
# tiny: for tests; minilm: the shape of all-MiniLM-L6-v2 (a common RAG embedder), for benchmarks
BERT_SIZES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "max_position_embeddings": 128, "vocab_size": 1024},
    "minilm": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536,
               "max_position_embeddings": 512, "vocab_size": 4096},
}


# The encoder architectures mlx-embeddings ships that the builder makes (same tokenizer, the family's config).
ENCODER_ARCHS = {
    "bert": {"architectures": ["BertModel"], "model_type": "bert", "type_vocab_size": 2, "layer_norm_eps": 1e-12,
             "hidden_act": "gelu"},
    "xlm-roberta": {"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "type_vocab_size": 1,
                    "layer_norm_eps": 1e-5},
    # local_attention 8: the tiny model's inputs reach past ModernBERT's sliding window
    "modernbert": {"architectures": ["ModernBertModel"], "model_type": "modernbert", "local_attention": 8,
                   "global_attn_every_n_layers": 2, "classifier_pooling": "mean"},
}


def bert_config(seed: int, size: str = "tiny", arch: str = "bert") -> dict:
    positions = BERT_SIZES[size]["max_position_embeddings"]
    extra = {"max_position_embeddings": positions + 2} if arch == "xlm-roberta" else {}  # RoBERTa's 2 offset
    kind = arch if size == "tiny" else f"{arch}-{size}"
    return {**ENCODER_ARCHS[arch], **BERT_SIZES[size], **extra, "pad_token_id": 0, "torch_dtype": "float32",
            **_build_info(kind, seed)}


@functools.lru_cache(maxsize=4)
def bert_tokenizer_json(vocab_size: int) -> str:
    """A lower-casing WordPiece tokenizer with BERT's pipeline and `[CLS] $A [SEP]` post-processing."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import WordPiece

    tokenizer = Tokenizer(WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(BERT_SPECIALS),
                                        show_progress=False)
    tokenizer.train_from_iterator(_generate_corpus(200_000), trainer=trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer.to_str()


def _bert_weights(config: dict, seed: int) -> dict:
    """Seeded weights under the parameter names of mlx-embeddings' own class (what its loader checks)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    family = importlib.import_module(f"mlx_embeddings.models.{config['model_type'].replace('-', '_')}")
    model = family.Model(family.ModelArgs.from_dict(config))
    shapes = dict(tree_flatten(model.parameters()))
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights = {}
    for i, name in enumerate(names):
        shape = shapes[name].shape
        if name.endswith(".bias"):
            weights[name] = mx.zeros(shape, dtype=mx.float32)
        elif len(shape) == 1 and "norm" in name.lower():
            weights[name] = mx.ones(shape, dtype=mx.float32)
        else:
            weights[name] = mx.random.normal(shape, dtype=mx.float32, key=keys[i]) * shape[-1] ** -0.5
    model.load_weights(list(weights.items()), strict=True)
    return weights


def build_bert_embedding(out_dir: str | Path, seed: int = 0, size: str = "tiny", arch: str = "bert") -> Path:
    """An encoder embedding model (`ENCODER_ARCHS`, `BERT_SIZES`) in `out_dir` (idempotent)."""
    out_dir = Path(out_dir).expanduser().resolve()
    config = bert_config(seed, size, arch)

    def write_payload(out: Path) -> None:
        tokenizer_json = bert_tokenizer_json(config["vocab_size"])
        vocab = json.loads(tokenizer_json)["model"]["vocab"]
        save_weights(out, _bert_weights(config, seed))
        atomic_write_bytes(out / "tokenizer.json", tokenizer_json.encode())
        atomic_write_bytes(out / "vocab.txt", "".join(f"{t}\n" for t, _ in sorted(vocab.items(), key=lambda x: x[1]))
                           .encode())
        atomic_write_json(out / "tokenizer_config.json", {
            "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": config[
                "max_position_embeddings"], "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
            "unk_token": "[UNK]", "mask_token": "[MASK]", "clean_up_tokenization_spaces": True})
        atomic_write_json(out / "special_tokens_map.json", {
            "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
            "mask_token": "[MASK]"})
        atomic_write_bytes(out / "README.md", README.format(what=f"{arch} embedding model").encode())

    write_build(out_dir, config, BERT_PAYLOAD, write_payload)
    return out_dir


# -- Qwen3-Embedding-style decoder ------------------------------------------------------------------
def decoder_config(seed: int, vocab_size: int = 2048, max_positions: int = 512) -> dict:
    ids = token_ids(vocab_size)
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "vocab_size": vocab_size, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
            "bos_token_id": ids[ENDOFTEXT], "eos_token_id": ids[ENDOFTEXT], "torch_dtype": "float32",
            **_build_info("decoder-embedding", seed)}


def decoder_tokenizer_json(vocab_size: int) -> str:
    """The test models' byte-level BPE, with Qwen3-Embedding's post-processor: `$A <|endoftext|>`."""
    data = json.loads(train_tokenizer_json(vocab_size))
    end = token_ids(vocab_size)[ENDOFTEXT]
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": ENDOFTEXT, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": ENDOFTEXT, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": ENDOFTEXT, "type_id": 1}}],
        "special_tokens": {ENDOFTEXT: {"id": ENDOFTEXT, "ids": [end], "tokens": [ENDOFTEXT]}},
    }
    return json.dumps(data, ensure_ascii=False, indent=2)


def build_decoder_embedding(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen3-Embedding-style decoder in `out_dir` (idempotent)."""
    out_dir = Path(out_dir).expanduser().resolve()
    config = decoder_config(seed)

    def write_payload(out: Path) -> None:
        model_config = {k: v for k, v in config.items() if k not in (MARKER_KEY, BUILD_INFO_KEY)}
        save_weights(out, decoder_random_weights(model_config, seed))
        atomic_write_bytes(out / "tokenizer.json", decoder_tokenizer_json(config["vocab_size"]).encode())
        tokenizer_config = qwen_tokenizer_config(config["vocab_size"], config["max_position_embeddings"])
        tokenizer_config.pop("chat_template", None)
        atomic_write_json(out / "tokenizer_config.json", {**tokenizer_config, "eos_token": ENDOFTEXT})
        atomic_write_json(out / "special_tokens_map.json", special_tokens_map())
        atomic_write_json(out / "modules.json", [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
        atomic_write_json(out / "config_sentence_transformers.json", {"prompts": {"query": "", "document": ""},
                                                                       "similarity_fn_name": "cosine"})
        (out / "1_Pooling").mkdir(exist_ok=True)
        atomic_write_json(out / "1_Pooling" / "config.json", {
            "word_embedding_dimension": config["hidden_size"], "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True})
        atomic_write_bytes(out / "README.md", README.format(what="tiny Qwen3-Embedding-style decoder").encode())

    write_build(out_dir, config, DECODER_PAYLOAD, write_payload)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`engined-build-embedding`); prints the model directory."""
    parser = argparse.ArgumentParser(prog="engined-build-embedding", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--kind", choices=(*ENCODER_ARCHS, "decoder"), default="bert",
                        help="an encoder for mlx-embeddings (bert, xlm-roberta, modernbert), or decoder: a "
                             "Qwen3-Embedding-style model for mlx-lm")
    parser.add_argument("--size", choices=sorted(BERT_SIZES), default="tiny", help="BERT size (default: tiny)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if args.kind != "decoder":
        print(build_bert_embedding(args.out_dir, seed=args.seed, size=args.size, arch=args.kind))
    else:
        print(build_decoder_embedding(args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
