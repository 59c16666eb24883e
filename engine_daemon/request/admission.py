"""One generation request as the engine sees it, and how its output is decoded.

Turns an ADD body into a prompt (chat template or raw text), settles max_tokens
against the context window, and turns sampled token ids into text deltas with
stop strings and finish reasons. Errors carry the HTTP-ish status the front-end
returns, so admission problems surface before the first token.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from engine_daemon.models.manager import LoadedModel
from engine_daemon.output.parser import OutputParser, ParsedDelta
from engine_daemon.output.stop_strings import StopStringMatcher
from engine_daemon.sampling.thinking import make_thinking_budget, prompt_in_thinking


class RequestError(Exception):
    """A request the engine refuses, with the status and code the client will see."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.error_type = error_type

    def to_body(self, rid: str | None) -> dict[str, Any]:
        return {"rid": rid, "status": self.status, "code": self.code, "message": str(self),
                "type": self.error_type, "param": self.param}


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
    arrived: float = field(default_factory=time.monotonic)  # when the engine got the ADD
    # {"mode": "truncated"|"summarized", "dropped_messages": n} when older turns made way (context_overflow.py)
    context_overflow: dict[str, Any] | None = None

    @property
    def params(self) -> dict[str, Any]:
        return self.body["params"]


def build_prompt(loaded: LoadedModel, body: dict[str, Any]) -> list[int]:
    """Token ids of the prompt: chat messages through the model's template, or raw text/ids."""
    tokenizer = loaded.tokenizer
    messages = body.get("messages")
    if messages is not None:
        if not getattr(tokenizer, "has_chat_template", True):
            raise RequestError(400, "chat_template_missing",
                               f"Model '{loaded.ref.id}' has no chat template; use /v1/completions",
                               param="messages")
        kwargs = dict(body.get("chat_template_kwargs") or {})
        tools = template_tools(body)
        if tools:
            kwargs["tools"] = tools
        try:
            tokens = tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                                   **kwargs)
        except Exception as exc:  # jinja raises its own exception types for template errors
            raise RequestError(400, "invalid_messages", f"The chat template rejected the messages: {exc}",
                               param="messages") from None
        return list(tokens)
    prompt = body["prompt"]
    if isinstance(prompt, list):
        return prompt
    return list(tokenizer.encode(prompt))


def template_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools the template describes; `tool_choice: "none"` means the model is not offered any."""
    if body.get("tool_choice") == "none":
        return None
    return body.get("tools") or None


def _arguments_object(arguments: Any) -> Any:
    """Templates render arguments with `tojson`: give them the object, not its JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as chat templates expect them (tool-call arguments as objects)."""
    prepared = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**call, "function": {**call.get("function", {}),
                                      "arguments": _arguments_object(call.get("function", {}).get("arguments"))}}
                for call in calls if isinstance(call, dict)]}
        prepared.append(message)
    return prepared


def settle_max_tokens(loaded: LoadedModel, prompt_len: int, requested: int | None, default: int) -> int:
    """max_tokens for a request, or RequestError when the context window cannot hold it."""
    window = loaded.context_window
    if prompt_len == 0:
        raise RequestError(400, "empty_prompt", "The prompt is empty", param="messages")
    if requested is not None and requested < 1:
        raise RequestError(400, "invalid_value", "max_tokens must be at least 1", param="max_tokens")
    if window is None:
        return requested or default
    if prompt_len >= window:
        raise RequestError(400, "context_length_exceeded",
                           f"This model's maximum context length is {window} tokens, "
                           f"but the prompt has {prompt_len} tokens", param="messages")
    if requested is None:
        return min(default, window - prompt_len)
    if prompt_len + requested > window:
        raise RequestError(400, "context_length_exceeded",
                           f"This model's maximum context length is {window} tokens. However, you "
                           f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
                           f"{requested} in the completion)", param="max_tokens")
    return requested


def resolve_sampling(loaded: LoadedModel, params: dict[str, Any], server_defaults: dict[str, Any]) -> dict[str, Any]:
    """Request field, else the model's generation_config.json, else the server's flags."""
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed")
    merged = {}
    for key in keys:
        for source in (params, loaded.generation_defaults, server_defaults):
            if source.get(key) is not None:
                merged[key] = source[key]
                break
    return merged


# param -> (lowest, highest) allowed; the engine checks what the front-end should already have.
PARAM_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "top_k": (-1, 2**31 - 1),
    "repetition_penalty": (1e-6, 100.0),
    "seed": (0, 2**63 - 1),
    "max_tokens": (1, 2**31 - 1),
    "top_logprobs": (0, 20),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}


def parse_logit_bias(raw: dict[str, Any] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias in [-100, 100]} as ints, checked against the vocabulary."""
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(400, "invalid_value", f"logit_bias key {key!r} is not a token id",
                               param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise RequestError(400, "invalid_value", f"logit_bias token {token} is outside [0, {vocab_size})",
                               param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(400, "invalid_value", "logit_bias values must be numbers in [-100, 100]",
                               param="logit_bias")
        bias[token] = float(value)
    return bias


def check_params(params: dict[str, Any]) -> None:
    """Out-of-range sampling values would fail inside a shared batch step: refuse them up front."""
    for name, (low, high) in PARAM_RANGES.items():
        value = params.get(name)
        if value is None:
            continue
        if not math.isfinite(value) or not low <= value <= high:
            raise RequestError(400, "invalid_value", f"'{name}' must be between {low} and {high}, got {value}",
                               param=name)


def check_token_ids(tokens: list[int], vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in tokens):
        raise RequestError(400, "invalid_value", f"prompt token ids must be in [0, {vocab_size})", param="prompt")


def prepare(request: EngineRequest, loaded: LoadedModel, default_max_tokens: int,
            server_defaults: dict[str, Any]) -> None:
    """Fills in prompt, limits, sampling and decoding state; raises RequestError to refuse."""
    request.model_id = loaded.ref.id
    check_params(request.params)
    request.prompt_tokens = build_prompt(loaded, request.body)
    if isinstance(request.body.get("prompt"), list):
        check_token_ids(request.prompt_tokens, loaded.vocab_size)
    # -- models-config max_tokens default; --context-overflow truncate/summarize (engine_daemon/request/context_overflow.py) --
    from engine_daemon.request.context_overflow import fit_context

    default_max_tokens = loaded.profile.max_tokens or default_max_tokens
    fit_context(request, loaded, default_max_tokens)
    # -- end of context overflow --
    try:
        request.max_tokens = settle_max_tokens(loaded, len(request.prompt_tokens),
                                               request.params.get("max_tokens"), default_max_tokens)
    except RequestError as exc:
        if exc.param == "messages" and request.body.get("messages") is None:
            exc.param = "prompt"  # a raw-prompt request (/v1/completions): name the field it sent
        raise
    request.sampling = resolve_sampling(loaded, request.params, server_defaults)
    request.sampling["logit_bias"] = parse_logit_bias(request.params.get("logit_bias"), loaded.vocab_size)
    request.stop = StopStringMatcher(request.params.get("stop"))
    request.detokenizer = loaded.tokenizer.detokenizer
    request.detokenizer.reset()
    # Reasoning and tool calls are split out of the text here, once, for every front-end.
    in_thinking = prompt_in_thinking(loaded.tokenizer, request.prompt_tokens)
    request.parser = OutputParser(loaded.tokenizer, in_thinking=in_thinking, tools=template_tools(request.body))
    budget = make_thinking_budget(loaded.tokenizer, request.params.get("thinking_budget"), in_thinking)
    if budget is not None:
        request.processors.append(budget)

    # -- Structured output / forced tool calls: a grammar constraint (engine_daemon/sampling/structured.py) --
    from engine_daemon.sampling.structured import constraint_for  # imports llguidance: only engine code gets here

    body = request.body
    constraint = constraint_for(loaded.tokenizer, body.get("response_format"), body.get("tools"),
                                body.get("tool_choice"), body.get("parallel_tool_calls"),
                                starts_in_thinking=in_thinking)
    if constraint is not None:
        request.processors.append(constraint)
    # -- end of structured output --
    # ignore_eos (a vLLM extension): generate exactly max_tokens, as benchmarks need.
    if not request.params.get("ignore_eos"):
        request.eos_token_ids = frozenset(loaded.tokenizer.eos_token_ids)


def consume_token(request: EngineRequest, token: int | None) -> ParsedDelta:
    """Adds one sampled token (None: generation ended without one); returns what is now safe to send.

    Sets finish_reason when done: "tool_calls" when a stop ended a reply that called tools.
    """
    if token is None:
        request.finish_reason = request.finish_reason or "length"
        return _parsed(request, request.stop.flush())
    detokenizer = request.detokenizer
    if token in request.eos_token_ids:
        request.finish_reason = "stop"
    else:
        detokenizer.add_token(token)
        request.generated += 1
        if request.parser is not None and request.parser.in_reasoning:
            request.reasoning_tokens += 1  # usage.completion_tokens_details.reasoning_tokens
        if request.generated >= request.max_tokens:
            request.finish_reason = "length"
    if request.finish_reason is not None:
        detokenizer.finalize()
    text = request.stop.feed(detokenizer.last_segment)
    if request.stop.matched is not None:
        request.finish_reason = "stop"
    elif request.finish_reason is not None:
        text += request.stop.flush()
    return _parsed(request, text)


def _parsed(request: EngineRequest, text: str) -> ParsedDelta:
    final = request.finish_reason is not None
    if request.parser is None:
        return ParsedDelta(text=text)
    delta = request.parser.feed(text, final=final)
    if final and request.finish_reason == "stop" and request.parser.tool_calls:
        request.finish_reason = "tool_calls"
    return delta


def logprob_entries(tokenizer: Any, logprobs: Any, token: int, top: int) -> list[dict[str, Any]]:
    """OpenAI's per-token logprobs entry: the sampled token and the `top` most likely ones."""
    import mlx.core as mx

    row = logprobs.reshape(-1)

    def describe(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        # A token masked out (grammar constraint) has logprob -inf, which JSON cannot carry: clamp
        # it as vLLM does.
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}

    entry = describe(token, row[token].item())
    entry["top_logprobs"] = []
    if top:
        ids = mx.argpartition(-row, kth=top - 1)[:top]
        pairs = sorted(zip(ids.tolist(), row[ids].tolist()), key=lambda pair: -pair[1])
        entry["top_logprobs"] = [describe(i, v) for i, v in pairs]
    return [entry]


def usage(request: EngineRequest, cached_tokens: int = 0) -> dict[str, int]:
    prompt = len(request.prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": request.generated,
            "total_tokens": prompt + request.generated, "cached_tokens": cached_tokens,
            "reasoning_tokens": request.reasoning_tokens}
