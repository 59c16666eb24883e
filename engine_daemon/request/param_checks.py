"""Range checks of a request's sampling values, stop strings and logit bias: pure, cheap, run first.

Out-of-range values would fail inside a shared batch step, so they are refused at admission;
the admission pool (`prepare_prompt`) runs them before it compiles a grammar, so a request
refused for its temperature never pays for its schema.
"""

from __future__ import annotations

import math
from typing import Any

from engine_daemon.errors import RequestError
from engine_daemon.output.stop_strings import MAX_STOP_LENGTH, MAX_STOP_STRINGS

# param -> (lowest, highest) allowed; the engine checks what the front-end should already have.
# Each has its type in `protocol.messages.PARAM_TYPES`, checked as the frame is decoded (a string here would raise).
PARAM_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "top_k": (-1, 2**31 - 1),
    "repetition_penalty": (1e-6, 100.0),
    "seed": (0, 2**63 - 1),
    "max_tokens": (0, 2**31 - 1),  # 0 only with prompt_logprobs (`settle_max_tokens`)
    "min_tokens": (0, 2**31 - 1),
    "top_logprobs": (0, 20),
    "prompt_logprobs": (0, 20),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "thinking_budget": (0, 2**31 - 1),
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


def check_stops(stops: list[Any] | None, max_count: int = MAX_STOP_STRINGS,
                max_length: int = MAX_STOP_LENGTH) -> None:
    """Stop strings are matched on every token of the request: their number and length are bounded."""
    if not stops:
        return
    if len(stops) > max_count:
        raise RequestError(400, "invalid_value", f"at most {max_count} stop strings are allowed, got "
                           f"{len(stops)}", param="stop")
    for stop in stops:
        if not isinstance(stop, str) or len(stop) > max_length:
            raise RequestError(400, "invalid_value", f"each stop string must be a string of at most "
                               f"{max_length} characters", param="stop")
