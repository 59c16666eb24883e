"""What one token is as text and bytes: a request's streaming detokenizer, and logprobs' token bytes.

Why: two places where the detokenizer's view of a token is not what a client needs.
- mlx-lm's streaming detokenizers drop the first generated token's leading space (the SPM
  word marker's, or a byte-level BPE `Ġ`). For a chat reply that matches what mlx-lm and
  `mlx_lm.server` write, but a raw-prompt completion (`/v1/completions`) continues the
  client's own text: "Once upon a time" + "Ġthere" must come back as " there", or the
  client's prompt + completion loses the space (editors and FIM clients concatenate them).
- A logprobs entry carries the token's `bytes`, which OpenAI defines as the token's own
  UTF-8 bytes, so that a client can join a character split over several tokens. Decoding
  one token of such a character gives U+FFFD, whose bytes are not the token's.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import _byte_decoder  # GPT-2's byte alphabet: the BPE token map's characters -> bytes

SPM_WORD_MARKER = "\u2581".encode("utf-8")


# Bytes (GPT-2 alphabet characters) a byte-level BPE detokenizer may hold back waiting for a character to complete.
MAX_UNFLUSHED = 16


def request_detokenizer(tokenizer: Any, continues_prompt: bool) -> Any:
    """A fresh streaming detokenizer; one that keeps the first leading space when the reply continues raw text."""
    detokenizer = tokenizer.detokenizer  # mlx-lm's TokenizerWrapper hands out a reset copy per call
    if continues_prompt:
        if hasattr(detokenizer, "trim_space"):  # mlx-lm's SPM, mlx-vlm's detokenizers
            detokenizer.trim_space = False
        if hasattr(detokenizer, "_maybe_trim_space"):  # mlx-lm's byte-level BPE trims unconditionally
            detokenizer._maybe_trim_space = _unchanged
    if hasattr(detokenizer, "_unflushed") and hasattr(detokenizer, "_decode_bytes"):
        _bound_unflushed(detokenizer)
    return detokenizer


def _bound_unflushed(detokenizer: Any) -> None:
    """mlx-lm's byte-level BPE detokenizer holds text back while it ends in an incomplete character and
    decodes all it holds on every token: a model writing invalid UTF-8 (a run of 0xFF bytes) sent no text
    at all and cost O(n²) (8,000 tokens: 9 s of the mlx thread). Past `MAX_UNFLUSHED` held bytes, all but
    the last three (the most a character can still be waiting for) go out, invalid bytes as U+FFFD."""
    add = detokenizer.add_token

    def add_token(token: int) -> None:
        add(token)
        held = detokenizer._unflushed
        if len(held) > MAX_UNFLUSHED:
            head, detokenizer._unflushed = held[:-3], held[-3:]
            detokenizer.text += detokenizer._maybe_trim_space(detokenizer._decode_bytes(head))

    detokenizer.add_token = add_token


def _unchanged(text: str) -> str:
    return text


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token stands for, also when they are only part of a UTF-8 character.

    Read from the streaming detokenizer's token map (mlx-lm's or mlx-vlm's): SPM maps hold
    bytes with the word marker, byte-level BPE maps hold GPT-2's byte alphabet. Any other
    tokenizer (or a token the map lacks) falls back to decoding the token alone.
    """
    template = getattr(tokenizer, "_detokenizer", None)
    tokenmap = getattr(template, "tokenmap", None)
    piece = tokenmap[token_id] if tokenmap is not None and 0 <= token_id < len(tokenmap) else None
    if isinstance(piece, bytes):
        return piece.replace(SPM_WORD_MARKER, b" ")
    if isinstance(piece, str) and "BPE" in type(template).__name__:
        decoder = _byte_decoder()
        if all(char in decoder for char in piece):
            return bytes(decoder[char] for char in piece)
    return tokenizer.decode([token_id]).encode("utf-8")


def token_label(raw: bytes) -> str:
    """The `token` string of a logprobs entry: its text, or OpenAI's `bytes:\\xNN` form when not valid UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
