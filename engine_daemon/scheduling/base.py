"""What every scheduler shares: admission, model resolution, request bookkeeping, stats.

The mlx thread drives a scheduler through `submit / abort / step`. Each step
produces at most one token per running request, so new requests and aborts are
looked at between every two tokens. `BatchScheduler` (continuous batching) is the
default; `SerialScheduler` runs one request at a time and serves the
combinations mlx-lm cannot batch (a quantized KV cache).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from engine_daemon.auxiliary.embedding import pooling_of
from engine_daemon.config import SchedulerConfig
from engine_daemon.cpu import decode_attention, prefill_attention, prefill_swiglu
from engine_daemon.cpu import parallel_ops as cpu_parallel
from engine_daemon.errors import RequestError, engine_failure
from engine_daemon.generation.speculative import SpeculativeDecoder
from engine_daemon.lora.adapters import AdapterManager
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.models.manager import ModelManager
from engine_daemon.models.store import NO_MODELS_NOTE, InvalidModelName, ModelNotFound, ModelRef
from engine_daemon.output.bounded_parse import timed_out as tool_parses_timed_out
from engine_daemon.output.tokens import consume_token, format_failure, logprob_entries, usage
from engine_daemon.request.admission import prepare
from engine_daemon.request.state import EngineRequest, PreparedPrompt
from protocol import MsgType

log = logging.getLogger(__name__)

# (peer identity, message type, body). DELTAS events carry one item; the worker groups them.
Event = tuple[bytes, MsgType, dict[str, Any]]


@dataclass
class SchedulerStats:
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    cached_tokens: int = 0
    max_batch_size: int = 0
    # Stall-free batching: steps whose prompt chunk rode in the decode pass, and the last chunk
    # size the token budget gave a prompt while others decoded (PrefillPacer).
    fused_prefill_steps: int = 0
    prefill_chunk_tokens: int = 0
    # Prompts whose first token came back from the step of their last chunk (`StallFreeBatchGenerator._step_ending`).
    first_tokens_at_prefill_end: int = 0
    # Chunks that left a fused pass between two layers to keep their step within the gap target, and carries of
    # such chunks rolled back (redone) because mlx-lm's own path took the prompt on (`LayerCarry`).
    prefill_layer_cuts: int = 0
    prefill_carry_rollbacks: int = 0
    # Requests taken while an idle engine waited for companions of the one that woke it (`--coalesce-ms`).
    coalesce_waits: int = 0
    coalesced_requests: int = 0
    # Requests paused to give a waiting client a slot, and resumed (`engine_daemon.scheduling.preemption`).
    requests_preempted: int = 0
    # Vision requests whose template and processor ran on the mlx thread: the admission pool had not built them.
    media_inputs_on_mlx_thread: int = 0
    rejections: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        values = {k: v for k, v in vars(self).items() if k != "rejections"}
        return {**values, "requests_rejected": sum(self.rejections.values()),
                "rejections": dict(self.rejections), "tool_parses_timed_out": tool_parses_timed_out()}


def not_found_message(not_found: ModelNotFound, current: LoadedModel | None) -> str:
    """The 404's text, naming the loaded model when the catalogue note left it out (a --model given as a path)."""
    message = str(not_found)
    if current is None or current.ref.id in message.partition(". Available models: ")[2]:
        return message
    if message.endswith(NO_MODELS_NOTE):
        return message.removesuffix(NO_MODELS_NOTE) + f". The loaded model is '{current.ref.id}'"
    return f"{message}; the loaded model is '{current.ref.id}'"


def error_event(request: EngineRequest, error: RequestError) -> Event:
    return (request.peer, MsgType.ERROR, error.to_body(request.rid))


class BaseScheduler:
    """Admission and bookkeeping; subclasses decide how admitted requests generate."""

    batching = False
    batching_note = ""

    def __init__(self, models: ModelManager, config: SchedulerConfig, stream: Any = None):
        self.models = models
        self.config = config
        # Set by the mlx thread: MLX streams belong to the thread that creates them.
        self.stream = stream
        self.stats = SchedulerStats()
        # Requests that wait for another model (or, in the serial scheduler, for their turn).
        self.waiting: deque[tuple[EngineRequest, ModelRef]] = deque()
        # LoRA adapters: registry, loaded weights, switching on the loaded model (AdapterManager).
        self.adapters = AdapterManager(config.model_dirs, config.adapter_cache_size, config.adapter_path,
                                       config.default_model)
        # --draft-model's decoder, where the scheduler decodes lone requests speculatively.
        self.speculative: SpeculativeDecoder | None = None
        self._fallback_logged: set[str] = set()  # unknown names already logged by `_fallback_for`

    # -- what the worker asks ------------------------------------------------------
    def has_work(self) -> bool:
        raise NotImplementedError

    def queued(self) -> int:
        raise NotImplementedError

    def running(self) -> int:
        raise NotImplementedError

    def worth_coalescing(self, window: float) -> bool:
        """Whether the work that woke the idle engine is worth waiting `window` for companions (`--coalesce-ms`)."""
        return False

    def prompt_cache_stats(self) -> dict[str, int]:
        """The prefix cache's counters for /stats; empty where the scheduler keeps none."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"scheduler": type(self).__name__, "batching": self.batching, "batching_note": self.batching_note,
                "decode_concurrency": self.config.decode_concurrency if self.batching else 1,
                "prompt_concurrency": self.config.prompt_concurrency if self.batching else 1,
                "cpu_parallel_ops": cpu_parallel.active_parts(),
                "cpu_prefill_attention": "numpy" if prefill_attention.enabled() else "mlx",
                "cpu_decode_attention": "numpy" if decode_attention.enabled() else "mlx",
                "cpu_decode_attention_layers": decode_attention.taken(),
                "cpu_prefill_swiglu": "numpy" if prefill_swiglu.enabled() else "mlx"}

    # -- admission -----------------------------------------------------------------
    def resolve_model(self, name: str | None, download: bool = True) -> ModelRef:
        """The model a request names: the loaded one, the default, or one found on disk.

        `download=False` (token counting, off the mlx thread) never starts a Hub download.
        """
        current = self.models.current
        if not name or name == "default":
            if current is not None:
                return current.ref
            if not self.config.default_model:
                raise RequestError(400, "model_required", "No model is loaded; name one in 'model'", param="model")
            name = self.config.default_model
        if current is not None and name in (current.ref.id, str(current.ref.path)):
            return current.ref
        # Aliases and the served name map to their sources; the operator's --model is trusted as typed;
        # any other name is confined to --model-dir and the HF cache (`ModelNames`).
        try:
            ref = self.models.names.resolve(name, default_model=self.config.default_model,
                                            roots=self.config.model_dirs,
                                            allow_download=self.config.allow_download and download)
        except InvalidModelName as exc:
            raise RequestError(400, "invalid_model_name", str(exc), param="model") from None
        except ModelNotFound as exc:
            if not self.config.model_fallback:
                raise RequestError(404, "model_not_found", not_found_message(exc, current), param="model") from None
            ref = self._fallback_for(name, exc, download)
        # The loaded directory under another spelling (its --model path vs. a name under --model-dir) is the
        # loaded model, not a reason to load the same weights again. Operator names keep their own
        # settings (a profile), so only unnamed spellings are folded together.
        if pooling_of(ref.path):  # loading it here would evict the chat model, then fail in mlx-lm
            raise RequestError(400, "invalid_model", f"The model '{name}' is an embedding model: use /v1/embeddings",
                               param="model")
        named = self.models.names.entries
        if (current is not None and ref.path == current.ref.path and ref.id not in named
                and current.ref.id not in named):
            return current.ref
        return ref

    def _fallback_for(self, name: str, not_found: ModelNotFound, download: bool = True) -> ModelRef:
        """`--model-fallback`: an unknown name (an agent's hard-coded `claude-…`) reaches the fallback model.

        `loaded` means whatever is loaded (else `--model`); any other value is a model name the
        operator typed, trusted like `--model`. Each unknown name is logged once (up to a bound).
        """
        fallback = self.config.model_fallback
        current = self.models.current
        if fallback == "loaded":
            if current is not None:
                ref = current.ref
            elif self.config.default_model:
                ref = self.models.names.resolve(self.config.default_model, default_model=self.config.default_model,
                                                roots=self.config.model_dirs, allow_download=False)
            else:
                raise RequestError(404, "model_not_found", str(not_found), param="model") from None
        else:
            try:
                ref = self.models.names.resolve(fallback, default_model=fallback, roots=self.config.model_dirs,
                                                allow_download=self.config.allow_download and download)
            except (ModelNotFound, InvalidModelName) as exc:
                raise RequestError(404, "model_not_found", f"{not_found} (and --model-fallback: {exc})",
                                   param="model") from None
        if name not in self._fallback_logged and len(self._fallback_logged) < 1024:
            self._fallback_logged.add(name)
            log.info("model %r is not known: served by %s (--model-fallback %s)", name[:255], ref.id, fallback)
        return ref

    def submit(self, peer: bytes, body: dict[str, Any], prepared: PreparedPrompt | None = None) -> list[Event]:
        """Admits or refuses a request. Refusals are answered at once, never queued."""
        request = EngineRequest(rid=body["rid"], peer=peer, body=body, prepared=prepared)
        self.stats.requests_added += 1
        try:
            if prepared is not None and prepared.refusal:
                raise prepared.error
            if any(other.rid == request.rid for other in self.all_requests()):
                raise RequestError(400, "duplicate_request_id", f"Request id {request.rid!r} is already in flight")
            ref = self.resolve_model(body.get("model"))
            current = self.models.current
            # Behind a pending model switch, later requests wait too (nobody is starved), except during
            # the switch delay, when requests for the loaded model still join its batch.
            if current is not None and current.ref == ref and (not self.waiting or self.switch_can_wait()):
                self.accept(request)  # 400s come first: retrying a request that can never run is no use
                made_room = self._check_queue(request)
                return made_room + self._admit(request)
            made_room = self._check_queue(request)
        except RequestError as exc:
            return [self.refuse(request, exc)]
        self.waiting.append((request, ref))
        return made_room

    def switch_can_wait(self) -> bool:
        """True while the oldest waiting request (one for another model) is within the switch delay."""
        return bool(self.waiting) and time.monotonic() - self.waiting[0][0].arrived < self.config.model_switch_delay

    def _check_queue(self, request: EngineRequest) -> list[Event]:
        """A full queue refuses the newcomer, unless a client queues 2+ more than the newcomer's: then that
        client's newest queued request gives up its place (max-min fair: one client cannot fill the queue)."""
        if self.queued() < self.config.max_queued:
            return []
        queued = [other for other in self.queued_requests() if other.preempted is None]  # not paused streams
        counts = Counter(other.client for other in queued)
        top, most = counts.most_common(1)[0] if counts else ("", 0)
        if top == request.client or most < counts[request.client] + 2:
            raise RequestError(429, "queue_full", f"The engine queue is full ({self.config.max_queued} "
                               "requests waiting); retry later", error_type="rate_limit_error")
        victim = [other for other in queued if other.client == top][-1]
        self.unqueue([victim])
        return [self.refuse(victim, RequestError(
            429, "queue_full", f"The engine queue is full ({self.config.max_queued} requests waiting) and this "
            "client held more of it than others: its newest request gave way; retry later",
            error_type="rate_limit_error"))]

    def queued_requests(self) -> list[EngineRequest]:
        """Requests waiting that no work was spent on yet, oldest first: what may give way in a full queue."""
        return [request for request, _ in self.waiting]

    def unqueue(self, requests: list[EngineRequest]) -> None:
        gone = {id(request) for request in requests}
        self.waiting = deque(item for item in self.waiting if id(item[0]) not in gone)

    def refuse(self, request: EngineRequest, error: RequestError) -> Event:
        self.stats.rejections[error.code] += 1
        log.info("rid=%s refused status=%d code=%s", request.rid, error.status, error.code)
        return error_event(request, error)

    def accept(self, request: EngineRequest) -> None:
        """Tokenises and checks the request against the loaded model; raises RequestError to refuse."""
        loaded = self.models.current
        prepare(request, loaded, self.config.default_max_tokens, self.config.sampling_defaults,
                (self.config.max_stop_strings, self.config.max_stop_length),
                clamp_max_tokens=self.config.max_tokens_overflow == "clamp")
        # The adapter (a name, a path under --model-dir, or --adapter-path's) settles into its cache key here.
        request.body["adapter"] = self.adapters.admit(request.body.get("adapter"), loaded)
        budget = self.config.memory_budget_bytes
        if budget is not None:
            needed = loaded.kv_bytes_per_token * (len(request.prompt_tokens) + request.max_tokens)
            if loaded.weights_bytes + needed > budget:
                raise RequestError(400, "memory_budget_exceeded",
                                   f"This request needs {needed / 2**20:.0f} MiB of KV cache "
                                   f"({len(request.prompt_tokens)} prompt + {request.max_tokens} new tokens); "
                                   f"with the model's {loaded.weights_bytes / 2**20:.0f} MiB it exceeds the "
                                   f"engine's memory budget of {budget / 2**20:.0f} MiB. Lower max_tokens.",
                                   param="max_tokens")
        request.accepted = True

    @staticmethod
    def accepted_event(request: EngineRequest) -> Event:
        log.info("rid=%s accepted model=%s prompt_tokens=%d cached_tokens=%d max_tokens=%d", request.rid,
                 request.model_id, len(request.prompt_tokens), request.cached_tokens, request.max_tokens)
        body = {"rid": request.rid, "prompt_tokens": len(request.prompt_tokens),
                "cached_tokens": request.cached_tokens, "model": request.model_id}
        if request.context_overflow:  # older turns dropped or summarised to fit (`fit_context`)
            body["context_overflow"] = request.context_overflow
        return (request.peer, MsgType.ACCEPTED, body)

    def _admit(self, request: EngineRequest) -> list[Event]:
        """Hands an accepted request for the loaded model to the generator."""
        raise NotImplementedError

    # -- output ---------------------------------------------------------------------
    def token_event(self, request: EngineRequest, token: int | None, logprobs: Any = None) -> Event:
        """DELTAS item for one sampled token (None: the generation ended with no new token).

        What the model generated is parsed here (stop strings, reasoning, tool calls): if that fails on
        some output, this request ends with an error (`finish_reason` "error" takes it out of the batch);
        raised on, the step would fail every request in flight.
        """
        try:
            return self._token_event(request, token, logprobs)
        except Exception as exc:
            log.exception("rid=%s: its output could not be processed; it ends with an error", request.rid)
            request.finish_reason = "error"
            self.stats.requests_aborted += 1
            return error_event(request, engine_failure(exc))

    def _token_event(self, request: EngineRequest, token: int | None, logprobs: Any = None) -> Event:
        if request.seq == 0 and log.isEnabledFor(logging.DEBUG):  # the engine's share of a client's TTFT
            log.debug("rid=%s first token %.1f ms after the engine got it", request.rid,
                      (time.monotonic() - request.arrived) * 1000)
        delta = consume_token(request, token)
        item: dict[str, Any] = {"rid": request.rid, "seq": request.seq, "text": delta.text}
        if delta.reasoning:
            item["reasoning"] = delta.reasoning
        if delta.tool_calls:
            item["tool_calls"] = delta.tool_calls
        if delta.tool_call_deltas:
            item["tool_call_deltas"] = delta.tool_call_deltas
        if token is not None and token not in request.eos_token_ids:
            item["token_ids"] = [token]
            self.stats.tokens_generated += 1
            if request.params.get("logprobs") and logprobs is not None:
                item["logprobs"] = logprob_entries(self.models.current.tokenizer, logprobs, token,
                                                      request.params.get("top_logprobs") or 0)
        request.seq += 1
        if request.finish_reason is not None and (failure := format_failure(request)) is not None:
            # The grammar gave up and steered to EOS: what was sent does not follow the format, so the
            # client gets an error rather than a "stop" that promises a complete reply.
            self.stats.requests_finished += 1
            log.warning("rid=%s ended: %s", request.rid, failure)
            return error_event(request, RequestError(
                500, "output_constraint_failed", f"Generation failed: {failure}; the reply is incomplete",
                error_type="server_error"))
        if request.finish_reason is not None:
            item["finish_reason"] = request.finish_reason
            item["usage"] = usage(request, request.cached_tokens)
            item["stop_sequence"] = request.stop.matched  # which stop string ended it (None: none did)
            self.stats.requests_finished += 1
            log.info("rid=%s finished reason=%s completion_tokens=%d", request.rid, request.finish_reason,
                     request.generated)
        return (request.peer, MsgType.DELTAS, item)

    def fail_all(self, status: int, code: str, message: str) -> list[Event]:
        """Ends every request with an error and drops all generation state (unload, internal error)."""
        error = RequestError(status, code, message, error_type="server_error")
        requests = self.all_requests()
        self.stats.requests_aborted += len(requests)
        self.reset()
        return [error_event(request, error) for request in requests]

    def reset(self) -> None:
        """Forgets every request and whatever holds on to the model."""
        self.waiting.clear()
        self.on_unload()

    def owned_by(self, peer: bytes, rids: set[str]) -> tuple[set[str], set[str]]:
        """Of `rids`, those `peer` sent and those another front-end sent: an ABORT ends its sender's own only."""
        owners = {request.rid: request.peer for request in self.all_requests() if request.rid in rids}
        mine = {rid for rid, owner in owners.items() if owner == peer}
        return mine, set(owners) - mine

    def abort_peer(self, peer: bytes) -> int:
        rids = {request.rid for request in self.all_requests() if request.peer == peer}
        return self.abort(rids) if rids else 0

    def all_requests(self) -> list[EngineRequest]:
        raise NotImplementedError

    def on_unload(self) -> None:
        """The model is about to be freed: drop whatever holds on to it."""

    def on_shutdown(self) -> None:
        """The engine stops cleanly: keep what should outlive it (the batch scheduler's disk prefixes)."""

    def abort(self, rids: set[str]) -> int:
        raise NotImplementedError

    def step(self) -> list[Event]:
        raise NotImplementedError

    def after_publish(self) -> None:
        """Work of the last step that its tokens need not wait for: run once they are sent (`MlxWorker`)."""
