"""Token-sized slices for Soprano-style TTS models, so a long sentence never holds the mlx thread.

mlx-audio's `generate` for Soprano synthesizes a whole segment (up to 512 language-model tokens,
then one Vocos decode) in one call: as one slice it would stall chat streams for seconds. Soprano
exposes the pieces `generate` is made of (`_preprocess_text` for its sentences, `_tokenize`,
`stream_generate`, which yields one hidden state per token, and `decoder`), so this drives them
itself, in `generate`'s own order and with its defaults (temperature 0.3, top-p 0.95, 512 tokens):
a slice advances at most a budget of tokens, and a sentence's audio is decoded and sent when its
last token is in. Seeded the same, the samples are `generate`'s, sentence by sentence.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TOKENS_PER_SLICE = 32
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

    def done(self) -> bool:
        return self._tokens is None and not self.sentences

    def advance(self, budget: int) -> np.ndarray | None:
        """Up to `budget` more tokens; the sentence's samples once it has ended, else None."""
        if self._tokens is None:
            ids = self.model._tokenize(self.sentences.pop(0))
            self._tokens = self.model.stream_generate(ids, max_tokens=self.max_tokens, temperature=0.3, top_p=0.95)
            self._hidden = []
        for _ in range(max(1, budget)):
            try:
                _, hidden = next(self._tokens)
            except StopIteration:
                self._tokens = None
                return self._audio()
            self._hidden.append(hidden)
        return None

    def _audio(self) -> np.ndarray:
        import mlx.core as mx

        audio = self.model.decoder(mx.concatenate(self._hidden, axis=1))
        size = self.model.config.decoder_config.token_size
        length = len(self._hidden) * size - size  # as Soprano's generate trims its decoder's lead-in
        audio = audio[0, -length:] if length > 0 else audio[0]
        return np.asarray(audio, dtype=np.float32).reshape(-1)
