"""One request at a time: for what mlx-lm cannot batch (a quantized KV cache, `--kv-bits`)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine_daemon.config import SchedulerConfig
from engine_daemon.errors import RequestError, engine_failure
from engine_daemon.models.manager import ModelManager
from engine_daemon.request.state import EngineRequest
from engine_daemon.sampling.samplers import make_request_processors, make_request_sampler
from engine_daemon.scheduling.base import BaseScheduler, Event, error_event

log = logging.getLogger(__name__)


class SerialScheduler(BaseScheduler):
    """FIFO queue in front of one running generation, on mlx-lm's generate_step.

    Used where batching is impossible: mlx-lm's BatchGenerator has no quantized KV cache.
    """

    batching_note = "serial: one request at a time"

    def accept(self, request: EngineRequest) -> None:
        """Text only: mlx-vlm's path batches and has no quantized KV cache, so it never runs here."""
        if getattr(self.models.current, "kind", "text") != "text":
            raise RequestError(400, "unsupported_model",
                               f"Model '{self.models.current.ref.id}' is a {self.models.current.kind} model; the "
                               "engine runs with --kv-bits (the serial text-only scheduler): restart it without "
                               "--kv-bits to serve vision models", param="model")
        if request.body.get("media"):
            raise RequestError(400, "unsupported_content",
                               f"Model '{self.models.current.ref.id}' takes text only; images and audio need a "
                               "vision model", param="messages")
        if request.params.get("prompt_logprobs") is not None:  # `PromptScoring` is the batch scheduler's
            raise RequestError(400, "unsupported_parameter", "Prompt logprobs are not available while the engine "
                               "runs with --kv-bits (one request at a time)", param="prompt_logprobs")
        super().accept(request)

    def __init__(self, models: ModelManager, config: SchedulerConfig, stream: Any = None):
        super().__init__(models, config, stream)
        self.current: EngineRequest | None = None
        self._tokens: Iterator[tuple[Any, Any]] | None = None
        if config.kv_bits:
            self.batching_note = f"--kv-bits {config.kv_bits}: mlx-lm cannot batch a quantized KV cache"

    def has_work(self) -> bool:
        return self.current is not None or bool(self.waiting)

    def queued(self) -> int:
        return len(self.waiting)

    def running(self) -> int:
        return 1 if self.current is not None else 0

    def all_requests(self) -> list[EngineRequest]:
        return [r for r, _ in self.waiting] + ([self.current] if self.current else [])

    def _admit(self, request: EngineRequest) -> list[Event]:
        self.waiting.append((request, self.models.current.ref))
        return [self.accepted_event(request)]

    def abort(self, rids: set[str]) -> int:
        found = 0
        if self.current is not None and self.current.rid in rids:
            self._finish_current()
            found += 1
        before = len(self.waiting)
        self.waiting = deque(item for item in self.waiting if item[0].rid not in rids)
        found += before - len(self.waiting)
        self.stats.requests_aborted += found
        return found

    def step(self) -> list[Event]:
        events: list[Event] = []
        while self.current is None and self.waiting:
            request, ref = self.waiting.popleft()
            try:
                if not request.accepted:
                    self.models.ensure(ref)
                    self.accept(request)
                    events.append(self.accepted_event(request))
                self._start(request)
            except RequestError as exc:
                events.append(self.refuse(request, exc))
            except Exception as exc:  # a failed load or prefill must not kill the engine
                log.exception("request %s failed to start", request.rid)
                events.append(error_event(request, engine_failure(exc)))
        if self.current is not None:
            events += self._advance()
        return events

    def _start(self, request: EngineRequest) -> None:
        config = self.config
        self._tokens = generate_step(
            mx.array(request.prompt_tokens), self.adapters.bind(self.models.current, request.body.get("adapter")),
            self.stream,
            max_tokens=request.max_tokens, sampler=make_request_sampler(request.sampling),
            logits_processors=make_request_processors(request.sampling) + request.processors,
            prefill_step_size=config.prefill_step_size, max_kv_size=config.max_kv_size,
            kv_bits=config.kv_bits, kv_group_size=config.kv_group_size,
            quantized_kv_start=config.quantized_kv_start,
        )
        self.current = request
        self.stats.prompt_tokens += len(request.prompt_tokens)
        self.stats.max_batch_size = max(self.stats.max_batch_size, 1)

    def _advance(self) -> list[Event]:
        request = self.current
        try:
            token, logprobs = next(self._tokens)
            event = self.token_event(request, int(token), logprobs)
        except StopIteration:
            event = self.token_event(request, None)
        except Exception as exc:
            log.exception("generation failed for %s", request.rid)
            self._finish_current()
            return [error_event(request, engine_failure(exc))]
        if request.finish_reason is not None:
            self._finish_current()
        return [event]

    def reset(self) -> None:
        super().reset()
        self._finish_current()

    def _finish_current(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
        self._tokens = None
        self.current = None
