"""A token's text and bytes as clients need them: raw completions keep their first space, logprobs the token's bytes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, load

from engine_daemon.output.token_text import request_detokenizer, token_bytes, token_label


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return load(tiny_model)  # byte-level BPE, like Qwen2's


def detokenized(detokenizer, ids: list[int]) -> str:
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def test_raw_completion_keeps_its_first_leading_space(tokenizer) -> None:
    ids = tokenizer.encode(" week week é", add_special_tokens=False)
    assert detokenized(request_detokenizer(tokenizer, continues_prompt=True), ids) == " week week é"
    # A chat reply reads as mlx-lm writes it (`mlx_lm.server`): the first space trimmed.
    assert detokenized(request_detokenizer(tokenizer, continues_prompt=False), ids) == "week week é"
    # Each call is a fresh detokenizer: the next request's is not the one just changed.
    assert detokenized(tokenizer.detokenizer, ids) == "week week é"


def test_token_bytes_are_the_tokens_own_even_inside_a_character(tokenizer) -> None:
    ids = tokenizer.encode(" é€", add_special_tokens=False)
    pieces = [token_bytes(tokenizer, token) for token in ids]
    assert b"".join(pieces) == " é€".encode()
    assert any(len(piece) == 1 and piece[0] >= 0x80 for piece in pieces), pieces  # a lone lead/continuation byte
    for piece in pieces:
        label = token_label(piece)
        try:
            assert label == piece.decode("utf-8")
        except UnicodeDecodeError:
            assert label == "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)


class SentencePieceStub:
    """Just enough of a tokenizer for mlx-lm's SPM detokenizer: a word marker, a byte token, plain pieces."""

    vocab = ["\u2581Once", "\u2581there", "<0xC3>", "<0xA9>", "s"]

    def __len__(self) -> int:
        return len(self.vocab)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.vocab[i] for i in ids]


class SentencePieceWrapper:
    def __init__(self) -> None:
        self._detokenizer = SPMStreamingDetokenizer(SentencePieceStub())

    @property
    def detokenizer(self):  # as mlx-lm's TokenizerWrapper: a reset copy per caller
        detokenizer = copy.copy(self._detokenizer)
        detokenizer.reset()
        return detokenizer


def test_sentencepiece_word_marker_and_byte_tokens() -> None:
    wrapper = SentencePieceWrapper()
    assert detokenized(request_detokenizer(wrapper, continues_prompt=True), [1, 4]) == " theres"
    assert detokenized(request_detokenizer(wrapper, continues_prompt=False), [1, 4]) == "theres"
    assert [token_bytes(wrapper, token) for token in (1, 2, 3)] == [b" there", b"\xc3", b"\xa9"]


def test_invalid_utf8_output_streams_as_replacement_characters(tokenizer) -> None:
    """Red team: a run of 0xFF byte tokens sent no text at all until the end, re-decoding all of it every token
    (O(n²): 8,000 tokens took 9 s of the mlx thread). Held bytes are now bounded; valid characters still join."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    alphabet = {byte: char for char, byte in _byte_decoder().items()}
    ff, c3, a9 = (tokenizer.convert_tokens_to_ids(alphabet[byte]) for byte in (0xFF, 0xC3, 0xA9))
    detokenizer = request_detokenizer(tokenizer, continues_prompt=False)
    for _ in range(1000):
        detokenizer.add_token(ff)
    assert len(detokenizer.text) >= 1000 - 20 and set(detokenizer.text) == {"\ufffd"}  # sent as it goes
    for token in [c3, a9] * 50:  # "é" split over two byte tokens, many times: never broken by the bound
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text.endswith("é" * 50) and detokenizer.text.count("\ufffd") == 1000
