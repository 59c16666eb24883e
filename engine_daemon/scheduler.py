"""Serial scheduler: one request generates at a time, the rest wait in FIFO order.

The interface (submit / abort / step) is what the mlx thread drives; each step
produces at most one token for the running request, so new requests and aborts
are looked at between every two tokens. Continuous batching replaces this class
behind the same interface.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from engine_daemon import requests as rq
from engine_daemon.model_manager import ModelManager
from engine_daemon.model_store import ModelNotFound, ModelRef, resolve
from engine_daemon.requests import EngineRequest, RequestError
from protocol import MsgType

log = logging.getLogger(__name__)

# (peer identity, message type, body)
Event = tuple[bytes, MsgType, dict[str, Any]]


@dataclass
class SchedulerConfig:
    default_model: str | None = None
    allow_download: bool = False
    default_max_tokens: int = 4096
    prefill_step_size: int = 2048
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_rejected: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0


class SerialScheduler:
    """FIFO queue in front of one running generation; loads models on demand."""

    def __init__(self, models: ModelManager, config: SchedulerConfig):
        self.models = models
        self.config = config
        self.stats = SchedulerStats()
        self.waiting: deque[tuple[EngineRequest, ModelRef]] = deque()
        self.running: EngineRequest | None = None
        self._tokens: Iterator[tuple[Any, Any]] | None = None

    # -- queue -------------------------------------------------------------
    def has_work(self) -> bool:
        return self.running is not None or bool(self.waiting)

    def queued(self) -> int:
        return len(self.waiting)

    def resolve_model(self, name: str | None) -> ModelRef:
        """The model a request names: the loaded one, the default, or one found on disk."""
        current = self.models.current
        if not name or name == "default":
            if current is not None:
                return current.ref
            if self.config.default_model:
                name = self.config.default_model
            else:
                raise RequestError(400, "model_required", "No model is loaded; name one in 'model'", param="model")
        if current is not None and name in (current.ref.id, str(current.ref.path)):
            return current.ref
        try:
            return resolve(name, allow_download=self.config.allow_download)
        except ModelNotFound as exc:
            raise RequestError(404, "model_not_found", str(exc), param="model") from None

    def submit(self, peer: bytes, body: dict[str, Any]) -> list[Event]:
        """Admits or refuses a request. Refusals are answered at once, never queued."""
        request = EngineRequest(rid=body["rid"], peer=peer, body=body)
        self.stats.requests_added += 1
        try:
            ref = self.resolve_model(body.get("model"))
            events = []
            current = self.models.current
            if current is not None and current.ref == ref:
                events = self._accept(request)
        except RequestError as exc:
            self.stats.requests_rejected += 1
            return [(peer, MsgType.ERROR, exc.to_body(request.rid))]
        self.waiting.append((request, ref))
        return events

    def _accept(self, request: EngineRequest) -> list[Event]:
        """Tokenises and checks the request against the loaded model; ACCEPTED on success."""
        rq.prepare(request, self.models.current, self.config.default_max_tokens, self.config.sampling_defaults)
        request.accepted = True
        body = {"rid": request.rid, "prompt_tokens": len(request.prompt_tokens), "cached_tokens": 0,
                "model": request.model_id}
        return [(request.peer, MsgType.ACCEPTED, body)]

    def abort(self, rids: set[str]) -> int:
        """Drops the requests at once; returns how many were found."""
        found = 0
        if self.running is not None and self.running.rid in rids:
            self._finish_running()
            found += 1
        before = len(self.waiting)
        self.waiting = deque(item for item in self.waiting if item[0].rid not in rids)
        found += before - len(self.waiting)
        self.stats.requests_aborted += found
        return found

    def abort_peer(self, peer: bytes) -> int:
        rids = {r.rid for r, _ in self.waiting if r.peer == peer}
        if self.running is not None and self.running.peer == peer:
            rids.add(self.running.rid)
        return self.abort(rids) if rids else 0

    def abort_all(self, status: int, code: str, message: str) -> list[Event]:
        """Ends every request with an error (model unload, shutdown)."""
        events = []
        everyone = [r for r, _ in self.waiting] + ([self.running] if self.running else [])
        for request in everyone:
            events.append((request.peer, MsgType.ERROR, RequestError(status, code, message,
                           error_type="server_error").to_body(request.rid)))
        self.waiting.clear()
        if self.running is not None:
            self._finish_running()
        return events

    # -- generation --------------------------------------------------------
    def step(self) -> list[Event]:
        """Starts the next request if none runs, then generates one token."""
        events: list[Event] = []
        while self.running is None and self.waiting:
            request, ref = self.waiting.popleft()
            try:
                if not request.accepted:
                    self.models.ensure(ref)
                    events += self._accept(request)
                self._start(request)
            except RequestError as exc:
                self.stats.requests_rejected += 1
                events.append((request.peer, MsgType.ERROR, exc.to_body(request.rid)))
            except Exception as exc:  # a failed load or prefill must not kill the engine
                log.exception("request %s failed to start", request.rid)
                events.append((request.peer, MsgType.ERROR, RequestError(
                    500, "engine_error", f"{type(exc).__name__}: {exc}", error_type="server_error",
                ).to_body(request.rid)))
        if self.running is not None:
            events += self._advance()
        return events

    def _start(self, request: EngineRequest) -> None:
        sampling = request.sampling
        if sampling.get("seed") is not None:
            mx.random.seed(sampling["seed"])
        sampler = make_sampler(
            temp=sampling.get("temperature", 0.0),
            top_p=sampling.get("top_p", 0.0),
            min_p=sampling.get("min_p", 0.0),
            top_k=sampling.get("top_k", 0),
        )
        penalty = sampling.get("repetition_penalty")
        # 1.0 is "no penalty": skip the processor rather than multiply every logit by one.
        processors = make_logits_processors(repetition_penalty=penalty if penalty not in (None, 1.0) else None)
        model = self.models.current.model
        self._tokens = generate_step(
            mx.array(request.prompt_tokens), model, max_tokens=request.max_tokens, sampler=sampler,
            logits_processors=processors, prefill_step_size=self.config.prefill_step_size,
        )
        self.running = request
        self.stats.prompt_tokens += len(request.prompt_tokens)

    def _advance(self) -> list[Event]:
        request = self.running
        try:
            token, _ = next(self._tokens)
        except StopIteration:
            request.finish_reason = request.finish_reason or "length"
            text = request.stop.flush()
        except Exception as exc:
            log.exception("generation failed for %s", request.rid)
            self._finish_running()
            return [(request.peer, MsgType.ERROR, RequestError(
                500, "engine_error", f"{type(exc).__name__}: {exc}", error_type="server_error",
            ).to_body(request.rid))]
        else:
            text = rq.consume_token(request, int(token))
            if request.finish_reason != "stop" or token not in request.eos_token_ids:
                self.stats.tokens_generated += 1
        item: dict[str, Any] = {"rid": request.rid, "seq": request.seq, "text": text}
        if request.finish_reason is None:
            item["token_ids"] = [int(token)]
        request.seq += 1
        if request.finish_reason is not None:
            item["finish_reason"] = request.finish_reason
            item["usage"] = rq.usage(request)
            self.stats.requests_finished += 1
            self._finish_running()
        return [(request.peer, MsgType.DELTAS, item)]

    def _finish_running(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
        self._tokens = None
        self.running = None
