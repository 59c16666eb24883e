"""Token-sized slices for Soprano-style TTS models, so a long sentence never holds the mlx thread.

mlx-audio's `generate` for Soprano synthesizes a whole segment (up to 512 language-model tokens,
then one Vocos decode) in one call: as one slice it would stall chat streams for seconds. Soprano
exposes the pieces `generate` is made of (`_preprocess_text` for its sentences, `_tokenize`,
`stream_generate`, which yields one hidden state per token, and `decoder`), so this drives them
itself, in `generate`'s own order and with its defaults (temperature 0.3, top-p 0.95, 512 tokens):
a slice advances at most a budget of tokens. Once a sentence's last token is in, its Vocos decode
(one call in `generate`: up to 512 tokens, ~1M samples, 1.6 s on 2 cores) is sliced too: each slice
decodes at most a budget of tokens plus `receptive_field` tokens of context on either side (the
decoder's config: its linear upsampling, convolutions and ISTFT overlap reach that far) and keeps
only its own tokens' samples (`token_size` each; the decode of L tokens is (L-1)*token_size samples,
token i starting at sample i*token_size). The context makes every kept sample the one-call decode's
(measured bit-identical on CPU; `test_sliced_decode_equals_one_call`). Seeded the same, the samples are
`generate`'s, sentence by sentence, sent a decode slice at a time. A decode slice reports its
tokens (`decoded`) so the aux queue learns a decode token's cost and sizes the next slices to about
a share of a chat decode step (the language-model slices report none: their tokens are cheaper).
"""

from __future__ import annotations

from typing import Any

import numpy as np

TOKENS_PER_SLICE = 32
MIN_DECODE_TOKENS = 8  # a decode slice's floor: its context (2 x receptive_field) stays a fraction of it
_PARTS = ("stream_generate", "_preprocess_text", "_tokenize", "decoder")


def supports(model: Any) -> bool:
    """A model built like mlx-audio's Soprano (the parts above and a decoder config with `token_size`)."""
    return all(hasattr(model, part) for part in _PARTS) and \
        hasattr(getattr(getattr(model, "config", None), "decoder_config", None), "token_size")


class TokenSteps:
    """The sentences of one input, synthesized a few tokens per `advance`."""

    def __init__(self, model: Any, text: str, max_tokens: int | None):
        self.model = model
        self.max_tokens = max_tokens or 512
        prompt = text.replace("\\n", "\n").replace("\\t", "\t")
        self.sentences = [item[0] for segment in prompt.split("\n") if segment.strip()
                          for item in model._preprocess_text([segment])]
        self._tokens: Any = None
        self._hidden: list[Any] = []
        self._decode: ChunkedDecode | None = None
        self.decoded = 0  # the sentence tokens the last `advance` decoded (0: it generated tokens)

    def done(self) -> bool:
        return self._tokens is None and self._decode is None and not self.sentences

    def advance(self, budget: int) -> np.ndarray | None:
        """Up to `budget` more tokens, or a decode slice of about `budget` tokens of the ended
        sentence; that slice's samples, else None."""
        self.decoded = 0
        if self._decode is not None:
            start = self._decode.position
            pcm = self._decode.next(budget)
            self.decoded = self._decode.position - start
            if self._decode.done():
                self._decode = None
            return pcm
        if self._tokens is None:
            ids = self.model._tokenize(self.sentences.pop(0))
            self._tokens = self.model.stream_generate(ids, max_tokens=self.max_tokens, temperature=0.3, top_p=0.95)
            self._hidden = []
        for _ in range(max(1, budget)):
            try:
                _, hidden = next(self._tokens)
            except StopIteration:
                self._tokens = None
                self._decode = ChunkedDecode(self.model, self._hidden)
                self._hidden = []
                return None
            self._hidden.append(hidden)
        return None


class ChunkedDecode:
    """One sentence's Vocos decode, a bounded number of hidden states per `next`."""

    def __init__(self, model: Any, hidden: list[Any]):
        import mlx.core as mx

        self.model = model
        self.hidden = mx.concatenate(hidden, axis=1)  # (1, N, C)
        self.count = len(hidden)
        config = model.config.decoder_config
        self.size = int(config.token_size)
        self.context = int(getattr(config, "receptive_field", 4))
        self.position = 0

    def done(self) -> bool:
        return self.position >= self.count

    def next(self, budget: int) -> np.ndarray:
        """The samples of the next `budget` (at least MIN_DECODE_TOKENS) tokens."""
        start = self.position
        end = min(self.count, start + max(MIN_DECODE_TOKENS, budget))
        self.position = end
        if start == 0 and end == self.count:
            return self._whole()
        low, high = max(0, start - self.context), min(self.count, end + self.context)
        audio = np.asarray(self.model.decoder(self.hidden[:, low:high])[0], dtype=np.float32).reshape(-1)
        first = (start - low) * self.size
        return audio[first:first + (end - start) * self.size] if end < self.count else audio[first:]

    def _whole(self) -> np.ndarray:
        audio = self.model.decoder(self.hidden)
        length = self.count * self.size - self.size  # as Soprano's generate trims its decoder's lead-in
        audio = audio[0, -length:] if length > 0 else audio[0]
        return np.asarray(audio, dtype=np.float32).reshape(-1)
