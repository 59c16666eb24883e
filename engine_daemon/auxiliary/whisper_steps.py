"""One Whisper window decoded in bounded slices, with mlx-audio's own code and exactly its result.

Why: `model.generate` on one 30-second window is an encoder pass plus up to `n_text_ctx / 2`
decoder tokens (more when the timestamps make it seek inside the window, or the temperature
fallback decodes again); run whole on the mlx thread, it stalls every chat stream for its
length. Rewriting mlx-audio's transcription loop to pause would fork ~300 lines of it (seeking,
fallback, word timings, hallucination rules) and drift from what `generate` returns.

How: `generate` runs unchanged inside a greenlet, which lives on the same OS thread (the mlx
thread, so MLX's one-thread rule holds) and can hand control back midway. For the window's
duration the model's `decode` is a `DecodingTask` subclass that pauses (switches back to the
job's `step`) before each decode run, after the encoder pass (and, while chat streams decode,
between the log-mel, the convolutions and each encoder block), and after every `budget` decoder
tokens. The values are those of mlx-audio's own `DecodingTask` (same filters, ranker, fallback
thresholds); only when MLX evaluates changes. Sampling (temperature > 0) draws from this
window's own key sequence, split exactly as MLX's global one after `mx.random.seed(seed)`, so
chat requests sampling between two slices neither disturb the transcript nor get disturbed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from greenlet import greenlet
from mlx_audio.stt.models.whisper.decoding import DecodingOptions, DecodingTask, GreedyDecoder, Inference

from engine_daemon.auxiliary.jobs import IDLE_BUDGET


class SliceClock:
    """Where a window's run may pause: tokens done in this slice against the slice's budget."""

    def __init__(self, key: mx.array):
        self.key = key  # the window's random key sequence (as MLX's global state after a seed)
        self.budget = 1
        self.tokens = 0  # decoder tokens run in the current slice
        self.busy = False  # any MLX work done in the current slice
        self.pause: Callable[[], None] = lambda: None

    @property
    def split_encoder(self) -> bool:
        """The encoder in pieces only when slices are small (streams decode); idle, one piece is cheaper."""
        return self.budget < IDLE_BUDGET

    def evaluated(self, value: mx.array) -> None:
        """`value` computed in this slice, then a pause: an encoder piece is a slice of its own."""
        mx.eval(value)
        self.busy = True
        self.maybe_pause()

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def maybe_pause(self) -> None:
        """Hands the mlx thread back once this slice did any work (the next slice starts here)."""
        if self.busy:
            mx.synchronize()  # the slice's queued work belongs to this slice, not the chat step after it
            self.pause()

    def token(self) -> None:
        if self.tokens >= self.budget:
            self.maybe_pause()
        self.tokens += 1
        self.busy = True


class _SlicedInference(Inference):
    def __init__(self, model: Any, clock: SliceClock):
        super().__init__(model)
        self.clock = clock

    def logits(self, tokens: mx.array, audio_features: mx.array) -> mx.array:
        self.clock.token()
        return super().logits(tokens, audio_features)


class _KeyedGreedyDecoder(GreedyDecoder):
    """mlx-audio's GreedyDecoder, sampling with the window's keys instead of MLX's global state."""

    def __init__(self, temperature: float, eot: int, clock: SliceClock):
        super().__init__(temperature, eot)
        self.clock = clock

    def update(self, tokens: mx.array, logits: mx.array, sum_logprobs: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if self.temperature == 0:
            next_tokens = logits.argmax(axis=-1)
        else:
            next_tokens = mx.random.categorical(logits / self.temperature, key=self.clock.next_key())
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        current_logprobs = logprobs[mx.arange(logprobs.shape[0]), next_tokens]
        sum_logprobs += current_logprobs * (tokens[:, -1] != self.eot)
        eot_mask = tokens[:, -1] == self.eot
        next_tokens = next_tokens * (1 - eot_mask) + self.eot * eot_mask
        tokens = mx.concatenate([tokens, next_tokens[:, None]], axis=-1)
        completed = mx.all(tokens[:, -1] == self.eot)
        return tokens, completed, sum_logprobs


class SlicedDecodingTask(DecodingTask):
    """mlx-audio's DecodingTask with pause points; its results are the parent's."""

    def __init__(self, model: Any, options: DecodingOptions, clock: SliceClock):
        super().__init__(model, options)
        self.inference = _SlicedInference(model, clock)
        self.decoder = _KeyedGreedyDecoder(options.temperature, self.tokenizer.eot, clock)
        self.clock = clock

    def _get_audio_features(self, mel: mx.array) -> mx.array:
        clock = self.clock
        clock.maybe_pause()  # the encoder starts a slice of its own
        if clock.split_encoder and mel.shape[-2:] != (self.model.dims.n_audio_ctx, self.model.dims.n_audio_state):
            # While chat streams decode: the log-mel, the convolutions, each block, each its own slice.
            # The same ops as AudioEncoder.__call__ in the same order, evaluated in pieces.
            encoder = self.model.encoder
            mel = mel.astype(mx.float16) if self.options.fp16 else mel
            clock.evaluated(mel)
            x = nn.gelu(encoder.conv2(nn.gelu(encoder.conv1(mel))))
            assert x.shape[1:] == encoder._positional_embedding.shape, "incorrect audio shape"
            x = x + encoder._positional_embedding
            for block in encoder.blocks:
                clock.evaluated(x)
                x, _, _ = block(x)
            features = encoder.ln_post(x)
            if features.dtype != (mx.float16 if self.options.fp16 else mx.float32):
                raise TypeError(f"audio_features has an incorrect dtype: {features.dtype}")
        else:
            features = super()._get_audio_features(mel)
        mx.eval(features)
        clock.busy = True
        clock.maybe_pause()
        return features


class SlicedWindow:
    """`model.generate(window, **kwargs)` run a slice at a time: `step(budget)` until `output` is set."""

    def __init__(self, model: Any, audio: mx.array, kwargs: dict[str, Any], seed: int):
        self.model = model
        self.clock = SliceClock(mx.random.key(seed))
        self.output: Any = None
        self._run = greenlet(lambda: self._generate(audio, kwargs))

    def _generate(self, audio: mx.array, kwargs: dict[str, Any]) -> None:
        self.output = self.model.generate(audio, **kwargs)

    def _decode(self, mel: mx.array, options: DecodingOptions = DecodingOptions(), **kwargs: Any) -> Any:
        """The model's `decode` during this window (mlx-audio's `decode`, through the sliced task)."""
        from dataclasses import replace

        single = mel.ndim == 2
        if single:
            mel = mel[None]
        if kwargs:
            options = replace(options, **kwargs)
        result = SlicedDecodingTask(self.model, options, self.clock).run(mel)
        return result[0] if single else result

    def step(self, budget: int) -> int:
        """One slice (about `budget` decoder tokens, or the encoder); the decoder tokens it ran."""
        clock = self.clock
        clock.budget, clock.tokens, clock.busy = max(1, budget), 0, False
        caller = greenlet.getcurrent()
        clock.pause = caller.switch
        self.model.decode = self._decode  # the instance's decode, for this slice only
        try:
            self._run.switch()
        finally:
            del self.model.decode
        return clock.tokens

    @property
    def done(self) -> bool:
        return self._run.dead

    def close(self) -> None:
        """Ends an unfinished run (its job was cancelled or failed) while the model still slices it."""
        if self._run:  # started and not finished
            self.model.decode = self._decode
            try:
                self._run.throw()
            finally:
                del self.model.decode
