"""Sampled token ids -> what the client sees: text deltas, finish reasons, logprobs, usage.

Each token goes through the streaming detokenizer, the stop-string matcher (hold-back) and
the output parser (reasoning / tool calls) of its request, in that order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine_daemon.output.parser import ParsedDelta
from engine_daemon.output.token_text import token_bytes, token_label

if TYPE_CHECKING:  # the request type only: requests are built above this layer
    from engine_daemon.request.state import EngineRequest


def consume_token(request: EngineRequest, token: int | None) -> ParsedDelta:
    """Adds one sampled token (None: generation ended without one); returns what is now safe to send.

    Sets finish_reason when done: "tool_calls" when a stop ended a reply that called tools.
    """
    if token is None:
        request.finish_reason = request.finish_reason or "length"
        return _parsed(request, request.stop.flush())
    detokenizer = request.detokenizer
    if token in request.eos_token_ids or _format_ends(request, token):
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


def _format_ends(request: EngineRequest, token: int) -> bool:
    """An EOS that a grammar constraint allowed: the format is complete, whatever `ignore_eos` says."""
    return any(processor.ends_output(token) for processor in request.processors if hasattr(processor, "ends_output"))


def format_failure(request: EngineRequest) -> str | None:
    """Why a grammar constraint gave up on the request's output (it was steered to EOS), or None."""
    return next((why for processor in request.processors if (why := getattr(processor, "failure", None))), None)


def _parsed(request: EngineRequest, text: str) -> ParsedDelta:
    final = request.finish_reason is not None
    if request.parser is None:
        return ParsedDelta(text=text)
    # "length": max_tokens or the context window ended it, so an open tool call was cut (`partial`).
    delta = request.parser.feed(text, final=final, cut=request.finish_reason == "length")
    # Only whole calls make a "tool_calls" finish: a call a stop string or an EOS cut off stays "stop".
    parser = request.parser
    if final and request.finish_reason == "stop" and parser.tool_calls and not parser.partial_calls \
            and request.stop.matched is None:
        request.finish_reason = "tool_calls"
    return delta


def describe_token(tokenizer: Any, token_id: int, logprob: float | None) -> dict[str, Any]:
    """One token of a logprobs entry: its text (or `bytes:` form), logprob and bytes (None: nothing predicts it)."""
    raw = token_bytes(tokenizer, token_id)  # the token's own bytes, also for part of a character
    # A token masked out (grammar constraint) has logprob -inf, which JSON cannot carry: clamp it as vLLM does.
    return {"token": token_label(raw), "logprob": None if logprob is None else max(logprob, -9999.0),
            "bytes": list(raw)}


def logprob_entries(tokenizer: Any, logprobs: Any, token: int, top: int) -> list[dict[str, Any]]:
    """OpenAI's per-token logprobs entry: the sampled token and the `top` most likely ones."""
    row = logprobs.reshape(-1)
    entry = describe_token(tokenizer, token, row[token].item())
    entry["top_logprobs"] = []
    if top:
        ids = mx.argpartition(-row, kth=top - 1)[:top]
        pairs = sorted(zip(ids.tolist(), row[ids].tolist()), key=lambda pair: -pair[1])
        entry["top_logprobs"] = [describe_token(tokenizer, i, v) for i, v in pairs]
    return [entry]


def usage(request: EngineRequest, cached_tokens: int = 0) -> dict[str, int]:
    prompt = len(request.prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": request.generated,
            "total_tokens": prompt + request.generated, "cached_tokens": cached_tokens,
            "reasoning_tokens": request.reasoning_tokens}
