"""The `engined` flags of the auxiliary slots (each with its environment variable).

Kept here rather than in `engine_daemon.cli` so that each kind's flag sits beside the
others of its feature; the CLI adds them to its parser and passes what they say on.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

# kind -> (flag, environment variable): the model preloaded into that kind's slot at start
PRELOAD_FLAGS: dict[str, tuple[str, str]] = {
    "embedding": ("--embedding-model", "MLX_ENGINE_EMBEDDING_MODEL"),
    "transcription": ("--transcription-model", "MLX_ENGINE_TRANSCRIPTION_MODEL"),
    "speech": ("--speech-model", "MLX_ENGINE_SPEECH_MODEL"),
}
AUX_STEP_TOKENS_ENV = "MLX_ENGINE_AUX_STEP_TOKENS"
DEFAULT_AUX_STEP_TOKENS = 0


def add_auxiliary_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--embedding-model", default=os.environ.get("MLX_ENGINE_EMBEDDING_MODEL") or None,
                        metavar="MODEL",
                        help="embedding model loaded at start into its own slot beside --model (a directory or an "
                             "HF repo id; BERT / XLM-R / ModernBERT through mlx-embeddings, Qwen3-Embedding-style "
                             "decoders through mlx-lm). /v1/embeddings requests naming an unknown model use it. "
                             "Without it, the first request naming an embedding model loads that one. "
                             "[MLX_ENGINE_EMBEDDING_MODEL]")
    parser.add_argument("--transcription-model", default=os.environ.get("MLX_ENGINE_TRANSCRIPTION_MODEL") or None,
                        metavar="MODEL",
                        help="Whisper model (mlx-audio's layout, e.g. mlx-community/whisper-large-v3-turbo) loaded "
                             "at start into its own slot beside --model, for /v1/audio/transcriptions and "
                             "/translations. Requests naming an unknown model (e.g. whisper-1) use it. Without it, "
                             "the first request naming a Whisper model loads that one. "
                             "[MLX_ENGINE_TRANSCRIPTION_MODEL]")
    parser.add_argument("--speech-model", default=os.environ.get("MLX_ENGINE_SPEECH_MODEL") or None,
                        metavar="MODEL",
                        help="text-to-speech model mlx-audio loads (e.g. a Soprano or Kokoro checkpoint) loaded at "
                             "start into its own slot beside --model, for /v1/audio/speech. Requests naming an "
                             "unknown model (e.g. tts-1) use it. Without it, the first request naming a TTS model "
                             "loads that one. [MLX_ENGINE_SPEECH_MODEL]")
    parser.add_argument("--aux-step-tokens", type=int,
                        default=int(os.environ.get(AUX_STEP_TOKENS_ENV, str(DEFAULT_AUX_STEP_TOKENS))),
                        help="tokens of auxiliary work (embedding batches) the mlx thread runs between two "
                             "generation steps. 0 sizes each slice from measured costs so that it adds at most "
                             "0.8 of a decode step to running streams' inter-token gaps (and runs large slices when "
                             "nothing decodes); N fixes it: smaller keeps chat streams smoother, larger serves "
                             f"embeddings faster. [{AUX_STEP_TOKENS_ENV}] (default: %(default)s)")


def auxiliary_config(args: argparse.Namespace) -> dict[str, Any]:
    """The `SchedulerConfig` fields the flags set."""
    preload = {kind: getattr(args, flag[2:].replace("-", "_"), None) for kind, (flag, _) in PRELOAD_FLAGS.items()}
    return {"auxiliary_models": {kind: name for kind, name in preload.items() if name},
            "aux_step_tokens": max(0, args.aux_step_tokens)}
