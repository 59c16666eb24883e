"""One generation request as the engine tracks it, from ADD to its last delta."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine_daemon.output.parser import OutputParser
from engine_daemon.output.stop_strings import StopStringMatcher


@dataclass
class PreparedPrompt:
    """A prompt rendered and tokenized off the mlx thread (`Preprocessor`), for one load of one model.

    `tokens` when it rendered, `error` when the request is to be refused, neither when the
    mlx thread should render it itself.
    """

    model_key: tuple[str, float]
    tokens: list[int] | None = None
    error: Any = None  # a RequestError
    # The request's logits processors (grammar constraint, thinking budget), built for `tokens`
    # (`in_thinking`: whether they end inside a thinking block): a grammar can take seconds to compile.
    processors: list[Any] | None = None
    in_thinking: bool | None = None
    # A vision request's model inputs (`VisionInputs`, built by `prepare_media_inputs`), or its images (RGB PIL)
    # and audio (float32 samples) decoded in `media` order (`decode_media`).
    media: Any = None
    # `error` is answered whatever model is loaded by then: refused before any rendering (a client's full share
    # of the pool, a request id already in the pool), not a refusal of this prompt by this model.
    refusal: bool = False


@dataclass
class EngineRequest:
    """Everything the scheduler tracks for one request, from ADD to its last delta."""

    rid: str
    peer: bytes
    body: dict[str, Any]
    model_id: str | None = None
    prompt_tokens: list[int] = field(default_factory=list)
    max_tokens: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: StopStringMatcher | None = None
    detokenizer: Any = None
    parser: OutputParser | None = None
    reasoning_tokens: int = 0  # generated while inside a thinking block
    eos_token_ids: frozenset[int] = frozenset()
    generated: int = 0
    cached_tokens: int = 0
    seq: int = 0
    finish_reason: str | None = None
    accepted: bool = False
    # Request-specific logits processors (grammar constraint, thinking budget), after the sampling ones.
    processors: list[Any] = field(default_factory=list)
    processor_spec: dict[str, Any] | None = None  # what they were built from (`build_processors`)
    arrived: float = field(default_factory=time.monotonic)  # when the engine got the ADD
    # {"mode": "truncated"|"summarized", "dropped_messages": n} when older turns made way (`fit_context`)
    context_overflow: dict[str, Any] | None = None
    # The prompt as prepared off the mlx thread, if it was (`Preprocessor`).
    prepared: PreparedPrompt | None = None
    # Its sampler, made once: a seeded one's key chain goes on after a pause (`engine_daemon.scheduling.preemption`).
    sampler: Any = None
    preempted: Any = None  # while paused for another client: the KV it resumes from (`Preempted`)
    prompt_scored: bool = False  # its prompt's own logprobs were sent (`PromptScoring`)

    @property
    def client(self) -> str:
        """Who asked, for fair shares of the batch (the front-end's digest of the API key, or `user`)."""
        return self.body.get("client") or ""

    @property
    def params(self) -> dict[str, Any]:
        return self.body["params"]
