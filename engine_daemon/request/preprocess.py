"""Prompt rendering, tokenization and grammar compiling off the mlx thread, with a size bound checked first.

A chat template and a tokenizer run on whatever a client sends: 4 MB of messages took
3.6 s on the mlx thread, and every stream of every client stood still meanwhile. So an
ADD for the loaded text model is rendered and tokenized here, on a small thread pool (the
tokenizers release the GIL; MLX work releases it too), and reaches the mlx thread with
its token ids ready (`PreparedPrompt`); the mlx thread uses them when the same model is
still loaded, and otherwise (a model switch meanwhile, another model's name) renders the
prompt itself as before. A vision request's inputs (template, media, processor) are built here
too (`prepare_media_inputs`, injected).

Before any rendering, a prompt that could not fit the context window even if every token
covered the longest token of the vocabulary is refused by its byte size alone, and a prompt of
token ids longer than the window by its length alone (one `len()`; its ids are checked here, not
on the io or mlx thread: 7 M ids took 1.4 s there, and every stream stood still).

The pool is shared fairly: requests wait in one queue per client (its peer and the ADD's `client`,
the scheduler's fair-share identity) and are taken round-robin, so one client's backlog delays
another's first request by about one render; a client holds at most --max-queued requests here
(429 `queue_full` beyond, as the scheduler's queue answers). A request aborted while it waits (or
whose front-end vanished) is dropped without being rendered.

On SIGTERM (`close`) every ADD and CALL the pool holds, waiting or being rendered, is answered once with
503 `engine_shutting_down` (the mlx thread never heard of them: before, their clients waited for the
front-end's timeout), and what was not rendered yet never is.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine_daemon.errors import SHUTTING_DOWN, RequestError, describe
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.request.context_overflow import DROPPED_BY_SIZE, overflow_mode
from engine_daemon.request.param_checks import check_params, parse_logit_bias
from engine_daemon.request.prompt import build_prompt
from engine_daemon.request.state import PreparedPrompt
from engine_daemon.sampling.request_processors import build_processors, processor_spec
from engine_daemon.sampling.thinking import prompt_in_thinking
from protocol.token_ids import packed_count, unpack_token_ids

log = logging.getLogger(__name__)

PREPROCESS_THREADS = 2
# Models whose text prompts render here: a vision model's text-only chat renders as a text model's does.
PROMPT_KINDS = ("text", "vision", "audio")
_LONGEST_TOKEN_ATTR = "_longest_token_bytes"
CALLS = (b"", "\0calls")  # the pool's queue of CALLs (`run_call`): taken in turn with the clients' ADDs

# (peer, ADD body, what was prepared or None) -> handed to the mlx thread
Deliver = Callable[[bytes, dict[str, Any], "PreparedPrompt | None"], None]
# (result, error): how a CALL run on the pool is answered (`Preprocessor.run_call`)
Answer = Callable[[Any, "RequestError | None"], None]
# (ADD body, loaded vision model) -> its model inputs, or RequestError (`prepare_media_inputs`)
DecodeMedia = Callable[[dict[str, Any], LoadedModel], list[Any]]


class PromptTooLarge(RequestError):
    """A prompt refused by its byte size alone (`check_size`), before any rendering."""


def model_key(loaded: LoadedModel) -> tuple[str, float]:
    """Identifies one load of one model: prepared tokens are only used with the tokenizer that made them."""
    return (loaded.ref.id, loaded.loaded_at)


def names_loaded_model(body: dict[str, Any], loaded: LoadedModel) -> bool:
    name = body.get("model")
    return not name or name == "default" or name in (loaded.ref.id, str(loaded.ref.path))


def longest_token_bytes(loaded: LoadedModel) -> int:
    """Bytes of the vocabulary's longest token (computed once per load, cached on the model)."""
    cached = getattr(loaded, _LONGEST_TOKEN_ATTR, None)
    if cached is None:
        try:
            vocab = loaded.tokenizer.get_vocab()
            cached = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=0) or 64
        except Exception:  # a tokenizer without a vocabulary listing: no bound from it
            cached = 0
        setattr(loaded, _LONGEST_TOKEN_ATTR, cached)
    return cached


def prompt_bytes(body: dict[str, Any]) -> int:
    """UTF-8 bytes of the strings a template renders from (messages, a raw prompt, tools)."""
    total = 0
    stack: list[Any] = [body.get("messages"), body.get("prompt"), body.get("tools")]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return total


def check_size(body: dict[str, Any], loaded: LoadedModel) -> None:
    """Refuses a prompt whose bytes could not fit the window in the best case, without tokenizing it."""
    window, longest = loaded.context_window, longest_token_bytes(loaded)
    if not window or not longest or isinstance(body.get("prompt"), TOKEN_PROMPTS):
        return
    size = prompt_bytes(body)
    if size > window * longest:
        raise PromptTooLarge(400, "context_length_exceeded",
                             f"This model's maximum context length is {window} tokens; the prompt's {size} bytes "
                             f"cannot fit in it (a token covers at most {longest} bytes)",
                             param="prompt" if body.get("messages") is None else "messages")


def drop_oversized_turns(body: dict[str, Any], loaded: LoadedModel) -> None:
    """A truncating chat's oldest non-system turns that could never fit, dropped by their bytes before any rendering.

    Only as many as the bytes demand, then any tool results of a dropped call: an agent's history is one
    user turn and hundreds of assistant and tool turns after it, so waiting for a user turn to stop at
    dropped all of them. `fit_context` then cuts what still does not fit by tokens, as `truncate` does.

    A prompt of more bytes than the window holds at the longest token cannot fit, so `truncate`
    would drop at least these; cutting them here, off the mlx thread, keeps a 16 MiB conversation
    from being rendered and tokenized whole (and again for each cut `truncate` tries).
    """
    window, longest = loaded.context_window, longest_token_bytes(loaded)
    messages = body["messages"]
    if not window or not longest:
        return
    excess, dropped = prompt_bytes(body) - window * longest, set()
    if excess <= 0:
        return
    for index, message in enumerate(messages[:-1]):  # the last message always stays
        if message.get("role") == "system":
            continue
        if excess <= 0 and message.get("role") != "tool":
            break  # enough dropped, and what is kept starts with no tool result whose call is gone
        dropped.add(index)
        excess -= prompt_bytes({"messages": [message]})
    body["messages"] = [message for index, message in enumerate(messages) if index not in dropped]
    body[DROPPED_BY_SIZE] = len(dropped)


TOKEN_PROMPTS = (list, bytes)  # a token prompt as ids, or packed (`protocol.token_ids`)


def check_token_prompt(prompt: list[Any] | bytes, loaded: LoadedModel) -> list[int]:
    """A prompt of token ids, as a list: refused by its length first (a packed one is not unpacked for that),
    then each id checked (in the vocabulary)."""
    window = loaded.context_window
    count = packed_count(prompt) if isinstance(prompt, bytes) else len(prompt)
    if window and count >= window:
        raise RequestError(400, "context_length_exceeded", f"This model's maximum context length is {window} tokens, "
                           f"but the prompt has {count} tokens", param="prompt")
    vocab = loaded.vocab_size
    if isinstance(prompt, bytes):
        ids = unpack_token_ids(prompt)  # unsigned: only the upper bound is left to check
        if ids and max(ids) >= vocab:
            raise RequestError(400, "invalid_value", f"prompt token ids must be integers in [0, {vocab})",
                               param="prompt")
        return ids
    if not all(type(token) is int and 0 <= token < vocab for token in prompt):  # a bool is not a token id
        raise RequestError(400, "invalid_value", f"prompt token ids must be integers in [0, {vocab})", param="prompt")
    return prompt


def prepare_prompt(body: dict[str, Any], loaded: LoadedModel) -> PreparedPrompt:
    """The prompt's tokens and the request's logits processors, or the refusal of either."""
    try:
        if isinstance(body.get("prompt"), TOKEN_PROMPTS):
            body["prompt"] = check_token_prompt(body["prompt"], loaded)  # first: its length costs nothing
        params = body.get("params") or {}
        check_params(params)  # before any compile: a refusal for a bad value costs nothing
        parse_logit_bias(params.get("logit_bias"), loaded.vocab_size)
        # A chat that may drop its oldest turns (`fit_context`) is refused only for what must stay (the last
        # turn, system prompt, tools).
        if overflow_mode(body, loaded) != "error" and body.get("messages") and not body.get("media"):
            drop_oversized_turns(body, loaded)
        check_size(body, loaded)
        tokens = build_prompt(loaded, body)
        in_thinking = prompt_in_thinking(loaded.tokenizer, tokens)
        # A grammar (structured output, forced tool calls) compiles here too: a large schema takes seconds.
        processors = build_processors(loaded.tokenizer, processor_spec(params, body), in_thinking)
        return PreparedPrompt(model_key(loaded), tokens=tokens, processors=processors, in_thinking=in_thinking)
    except RequestError as exc:
        return PreparedPrompt(model_key(loaded), error=exc)
    except Exception as exc:  # a tokenizer bug must not lose the request: the mlx thread retries it
        log.warning("preparing a prompt failed (%s): the mlx thread renders it", describe(exc))
        return PreparedPrompt(model_key(loaded))


@dataclass(eq=False)
class _Job:
    """One ADD waiting in the pool: `run` renders it (`Preprocessor._run` or `_run_media`)."""

    run: Callable[[bytes, dict[str, Any], LoadedModel], None]
    peer: bytes
    body: dict[str, Any]
    loaded: LoadedModel
    owner: tuple[bytes, str]
    started: bool = False  # taken off its queue by a pool thread


class Preprocessor:
    """Renders and tokenizes ADDs on a thread pool, then hands them on in a `Deliver` call.

    ADDs wait in one queue per client (`owner`) and are taken round-robin. Aborts and vanished
    front-ends are honoured for requests still in the pool: one still waiting is never rendered,
    one being rendered is not delivered. Refusals made here (a client's full share of the pool,
    a request id already in the pool) are delivered as a `PreparedPrompt` with `refusal` set.
    """

    def __init__(self, current_model: Callable[[], LoadedModel | None], deliver: Deliver,
                 threads: int = PREPROCESS_THREADS, decode_media: DecodeMedia | None = None,
                 max_queued: int = 256):
        self._current_model = current_model
        self._deliver = deliver
        self._decode_media = decode_media  # a vision request's images and audio (`engine_daemon.multimodal`)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="admission")
        self._lock = threading.Lock()
        self._pending: dict[str, _Job] = {}  # rid -> its job, from submit until delivered or cancelled
        self._queues: OrderedDict[tuple[bytes, str], deque[_Job]] = OrderedDict()  # per owner, next owner first
        self._held: Counter[tuple[bytes, str]] = Counter()  # owner -> its requests in `_pending`
        self._calls: dict[_Job, Answer] = {}  # CALLs waiting or running -> how each is answered (once)
        self._closed = False  # `close`: all it held was answered; ADDs and CALLs from now on are refused
        self.max_queued = max_queued  # per owner (--max-queued)
        self.counts = {"prompts_prepared": 0, "prompts_refused_by_size": 0, "prompts_refused_off_thread": 0,
                       "processors_prepared": 0,  # requests whose grammar / thinking budget was built here
                       "media_decoded": 0,  # vision requests whose images / audio were decoded here
                       "prompts_dropped_unrendered": 0}  # aborted (or their front-end gone) while waiting here

    @staticmethod
    def owner_of(peer: bytes, body: dict[str, Any]) -> tuple[bytes, str]:
        """Whose share of the pool an ADD takes: its front-end and its `client` (API key digest, else `user`)."""
        return (peer, body.get("client") or "")

    def submit(self, peer: bytes, body: dict[str, Any]) -> None:
        """Called by the io thread for every ADD; delivers at once what the pool cannot help with."""
        loaded = self._current_model()
        if (body.get("media") and loaded is not None and loaded.vision is not None and self._decode_media
                and names_loaded_model(body, loaded)):
            run = self._run_media
        elif (loaded is None or loaded.kind not in PROMPT_KINDS or body.get("media")
                or not names_loaded_model(body, loaded)
                or (body.get("messages") is None and not isinstance(body.get("prompt"), (str, *TOKEN_PROMPTS)))):
            self._deliver(peer, body, None)
            return
        else:
            run = self._run
        job = _Job(run, peer, body, loaded, self.owner_of(peer, body))
        with self._lock:
            refusal = self._refusal(job)
            if refusal is None:
                self._pending[body["rid"]] = job
                self._held[job.owner] += 1
                self._queues.setdefault(job.owner, deque()).append(job)
        if refusal is not None:
            log.info("rid=%s refused before the admission pool: %s", body["rid"], refusal.code)
            # Its id only: a flood's refused bodies are freed here, not held in the mlx thread's command queue.
            self._deliver(peer, {"rid": body["rid"], "params": {}},
                          PreparedPrompt(model_key(loaded), error=refusal, refusal=True))
            return
        self._submit()

    def _submit(self) -> None:
        """One pool task for a job just queued; a pool shut down since then (`close`) has answered that job."""
        try:
            self._pool.submit(self._next)
        except RuntimeError:
            pass  # the pool was shut down meanwhile: `close` answered the job

    def _refusal(self, job: _Job) -> RequestError | None:
        """Why an ADD may not wait in the pool (a duplicate id, its client's share full), else None. Under the lock."""
        if self._closed:
            return SHUTTING_DOWN
        if job.body["rid"] in self._pending:
            return RequestError(400, "duplicate_request_id", f"Request id {job.body['rid']!r} is already in flight")
        if self._held[job.owner] >= self.max_queued:
            return RequestError(429, "queue_full", f"The engine queue is full ({self.max_queued} of this client's "
                                "requests waiting to be rendered); retry later", error_type="rate_limit_error")
        return None

    def _next(self) -> None:
        """One pool task: renders the next live job, round-robin over owners (one task is submitted per job)."""
        with self._lock:
            job = None
            while self._queues and job is None:
                owner, jobs = next(iter(self._queues.items()))
                candidate = jobs.popleft()
                if jobs:
                    self._queues.move_to_end(owner)
                else:
                    del self._queues[owner]
                if candidate in self._calls or self._pending.get(candidate.body.get("rid")) is candidate:
                    job, candidate.started = candidate, True
        if job is not None:
            job.run(job.peer, job.body, job.loaded)

    def _hand_on(self, peer: bytes, body: dict[str, Any], prepared: PreparedPrompt) -> None:
        """Delivers a rendered job unless it was aborted meanwhile. Under the lock."""
        job = self._pending.get(body["rid"])
        if job is None or job.body is not body:
            return  # aborted while it was being prepared
        self._forget(body["rid"])
        # Handed on under the lock: an ABORT the io thread sends now queues after this ADD.
        self._deliver(peer, body, prepared)

    def _forget(self, rid: str) -> _Job:
        job = self._pending.pop(rid)
        self._held[job.owner] -= 1
        if not self._held[job.owner]:
            del self._held[job.owner]
        return job

    def _run_media(self, peer: bytes, body: dict[str, Any], loaded: LoadedModel) -> None:
        """Builds a vision request's model inputs here (template, media, processor); the mlx thread takes them."""
        try:
            prepared = PreparedPrompt(model_key(loaded), media=self._decode_media(body, loaded))
        except RequestError as exc:
            prepared = PreparedPrompt(model_key(loaded), error=exc)
        except Exception as exc:  # a decoder bug must not lose the request: the mlx thread decodes it
            log.warning("decoding a request's media failed (%s): the mlx thread decodes it", describe(exc))
            prepared = PreparedPrompt(model_key(loaded))
        with self._lock:
            self.counts["media_decoded"] += 1
            self._hand_on(peer, body, prepared)

    def _run(self, peer: bytes, body: dict[str, Any], loaded: LoadedModel) -> None:
        prepared = prepare_prompt(body, loaded)
        with self._lock:
            self.counts["prompts_prepared"] += 1
            self.counts["processors_prepared"] += bool(prepared.processors)
            if prepared.error is not None:
                self.counts["prompts_refused_off_thread"] += 1
                if isinstance(prepared.error, PromptTooLarge):
                    self.counts["prompts_refused_by_size"] += 1
            self._hand_on(peer, body, prepared)

    def run_call(self, call: Callable[[], Any], answer: Answer) -> None:
        """Runs a CALL that tokenizes (`/tokenize`) on the pool; `answer(result, error)` when done, exactly once
        (a CALL the pool still holds at `close` is answered there, and its result, if any comes, dropped)."""
        def run() -> None:
            try:
                result, error = call(), None
            except RequestError as exc:
                result, error = None, exc
            except Exception as exc:
                log.exception("a pool CALL failed")
                result, error = None, RequestError(500, "engine_error", describe(exc), error_type="server_error")
            with self._lock:
                if self._calls.pop(job, None) is None:
                    return  # answered by `close`
            answer(result, error)

        job = _Job(lambda *_: run(), b"", {}, None, CALLS)
        with self._lock:  # a turn of its own: a client's backlog of ADDs does not hold it up
            closed = self._closed
            if not closed:
                self._calls[job] = answer
                self._queues.setdefault(CALLS, deque()).append(job)
        if closed:
            answer(None, SHUTTING_DOWN)
            return
        self._submit()

    def cancel(self, peer: bytes, rids: list[str]) -> None:
        """An ABORT: drops those of `rids` that `peer` sent (another front-end's requests are not its to end)."""
        with self._lock:
            for rid in rids:
                job = self._pending.get(rid)
                if job is None:
                    continue
                if job.peer != peer:
                    log.info("rid=%s: ABORT from another front-end ignored", rid)
                    continue
                self._drop(rid)

    def cancel_peer(self, peer: bytes) -> None:
        with self._lock:
            for owner in [owner for owner in self._queues if owner[0] == peer]:
                del self._queues[owner]  # whole queues at once: a vanished flood costs one pass
            for rid in [rid for rid, job in self._pending.items() if job.peer == peer]:
                self._drop(rid)

    def _drop(self, rid: str) -> None:
        """Forgets a pending job (under the lock): one still waiting leaves its queue, never rendered."""
        job = self._forget(rid)
        if not job.started:
            self.counts["prompts_dropped_unrendered"] += 1
            jobs = self._queues.get(job.owner)
            if jobs is not None:
                jobs.remove(job)  # by identity (`_Job` has no __eq__)
                if not jobs:
                    del self._queues[job.owner]

    def stats(self) -> dict[str, int]:
        """For /stats: prompts rendered off the mlx thread, and how many of those were refused there."""
        with self._lock:
            return {**self.counts, "prompts_preparing": len(self._pending)}

    def close(self) -> list[tuple[bytes, str]]:
        """Stops the pool (SIGTERM, or the mlx thread died): each CALL it holds is answered with `SHUTTING_DOWN`
        now; the (peer, rid) of each ADD it held (waiting or being rendered) is returned for the io thread to
        answer so. None of them is handed on afterwards; those still waiting are never rendered."""
        with self._lock:
            self._closed = True
            calls, self._calls = list(self._calls.values()), {}
            adds = [(job.peer, rid) for rid, job in self._pending.items()]
            self.counts["prompts_dropped_unrendered"] += sum(not job.started for job in self._pending.values())
            self._pending.clear()
            self._held.clear()
            self._queues.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for answer in calls:
            answer(None, SHUTTING_DOWN)
        return adds
