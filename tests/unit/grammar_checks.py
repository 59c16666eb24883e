"""What a grammar allows, read from llguidance's token mask: shared by the constrained-decoding unit tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from engine_daemon.sampling.structured import llg_tokenizer


def allowed_ids(matcher: LLMatcher, vocab_size: int) -> list[int]:
    """The token ids `matcher` allows next (asserting it is not in error)."""
    mask = allocate_token_bitmask(1, vocab_size)
    fill_next_token_bitmask(matcher, mask)
    assert not matcher.is_error(), matcher.get_error()
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]).tolist()


def spell(matcher: LLMatcher, tokenizer: Any, text: str, then: tuple[int, ...] = ()) -> bool:
    """Feeds `matcher` `text` in ordinary tokens (the longest allowed one each time), then the tokens `then`;
    whether the grammar allowed all of it."""
    vocabulary = llg_tokenizer(tokenizer)
    rest = text.encode()
    while rest:
        candidates = [(len(piece), token) for token in allowed_ids(matcher, vocabulary.vocab_size)
                      if not vocabulary.is_special_token(token)
                      and (piece := vocabulary.decode_bytes([token])) and rest.startswith(piece)]
        if not candidates:
            return False
        length, token = max(candidates)
        if not matcher.consume_token(token):
            return False
        rest = rest[length:]
    return all(token in allowed_ids(matcher, vocabulary.vocab_size) and matcher.consume_token(token)
               for token in then)


def accepts(matcher: LLMatcher, tokenizer: Any, text: str, then: tuple[int, ...] = ()) -> bool:
    """Whether a copy of `matcher` takes `text` in ordinary tokens, then the tokens `then`, and is complete there."""
    matcher = matcher.deep_copy()
    return spell(matcher, tokenizer, text, then) and matcher.is_accepting()
