"""Sampling and limit fields every generation route shares, and the fields refused outright.

Omitted fields stay unset, so the engine applies its own defaults (the model's
`generation_config.json`, then the engine's flags). Chat, Completions and Responses
take `parse_sampling` as it is; the Anthropic route names these fields its own way
and shares `MAX_STOP_STRINGS` and the operator's ceiling (`check_max_tokens`).
"""

from __future__ import annotations

from typing import Any

from http_frontend.errors import bad_request
from http_frontend.parsing.body import get_field

# Default bounds on stop strings, the same as the engine's (`engine_daemon.output.stop_strings`), repeated
# since the front-end never imports the daemon; an operator sets both with --max-stop-strings and
# --max-stop-length (`FrontendSettings`), refused here before any engine work.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters of one stop string
MAX_CHOICES = 16  # most `n`: each choice is an engine request of its own (`choice_requests`)

# Fields this server does not implement yet: refused with a 400 rather than silently ignored.
UNSUPPORTED = {
    "functions": "The deprecated 'functions' field is not supported; use 'tools'",
    "function_call": "The deprecated 'function_call' field is not supported; use 'tool_choice'",
    "audio": "Audio output is not supported",
}


def parse_stop(body: dict[str, Any], max_count: int = MAX_STOP_STRINGS,
               max_length: int = MAX_STOP_LENGTH) -> list[str] | None:
    stop = get_field(body, "stop", (str, list))
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > max_count or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"'stop' must be a string or a list of at most {max_count} strings", param="stop")
    check_stop_lengths(stops, "stop", max_length)
    return [s for s in stops if s]


def check_stop_lengths(stops: list[str], param: str, max_length: int = MAX_STOP_LENGTH) -> None:
    """Each stop string is matched against every token's text: longer than `max_length` is a 400."""
    longest = max((len(s) for s in stops), default=0)
    if longest > max_length:
        raise bad_request(f"Invalid '{param}': each stop string may be at most {max_length} characters, got "
                          f"one of {longest}", param=param)


def parse_sampling(body: dict[str, Any], max_stops: int = MAX_STOP_STRINGS,
                   max_stop_length: int = MAX_STOP_LENGTH) -> dict[str, Any]:
    """Sampling and limit fields shared by the generation routes; omitted ones stay unset."""
    max_tokens = get_field(body, "max_completion_tokens", (int,), minimum=1)
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", (int,), minimum=1)
    top_k = get_field(body, "top_k", (int,), minimum=-1)
    params = {
        "max_tokens": max_tokens,
        "temperature": get_field(body, "temperature", (float,), minimum=0, maximum=2),
        "top_p": get_field(body, "top_p", (float,), minimum=0, maximum=1),
        "top_k": 0 if top_k == -1 else top_k,
        "min_p": get_field(body, "min_p", (float,), minimum=0, maximum=1),
        "repetition_penalty": get_field(body, "repetition_penalty", (float,), minimum=0.01),
        "seed": get_field(body, "seed", (int,)),
        "stop": parse_stop(body, max_stops, max_stop_length),
        "ignore_eos": get_field(body, "ignore_eos", (bool,)),
        "min_tokens": get_field(body, "min_tokens", (int,), minimum=0) or None,  # vLLM's: no EOS before this many
    }
    if params["min_tokens"] and max_tokens is not None and params["min_tokens"] > max_tokens:
        raise bad_request(f"'min_tokens' ({params['min_tokens']}) must not exceed 'max_tokens' ({max_tokens})",
                          param="min_tokens")
    for name in ("presence_penalty", "frequency_penalty"):
        params[name] = get_field(body, name, (float,), minimum=-2, maximum=2)
    params["logit_bias"] = parse_logit_bias(body)
    return {k: v for k, v in params.items() if v is not None}


def parse_logit_bias(body: dict[str, Any]) -> dict[str, float] | None:
    """OpenAI's {"token id": bias}: ids as strings (msgpack map keys), biases in [-100, 100]."""
    bias = get_field(body, "logit_bias", (dict,))
    if not bias:
        return None
    checked = {}
    for key, value in bias.items():
        if not str(key).lstrip("-").isdigit():
            raise bad_request(f"Invalid key in 'logit_bias': {key!r} is not a token id", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"Invalid value in 'logit_bias' for {key}: expected a number in [-100, 100]",
                              param="logit_bias")
        checked[str(int(key))] = float(value)
    return checked


def parse_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """Chat's `logprobs` (bool) and `top_logprobs` (0-20, only with logprobs)."""
    wanted = get_field(body, "logprobs", (bool,), default=False)
    top = get_field(body, "top_logprobs", (int,), minimum=0, maximum=20)
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    return {"logprobs": True, "top_logprobs": top or 0} if wanted else {}


def check_unsupported(body: dict[str, Any], logprobs_supported: bool = False) -> None:
    """400s naming the field: anything in UNSUPPORTED, `n` past MAX_CHOICES, `logprobs` where not supported."""
    for name, message in UNSUPPORTED.items():
        if body.get(name):
            raise bad_request(message, param=name, code="unsupported_parameter")
    get_field(body, "n", (int,), minimum=1, maximum=MAX_CHOICES)
    if not logprobs_supported and body.get("logprobs"):
        raise bad_request("'logprobs' is not supported yet", param="logprobs", code="unsupported_parameter")


def check_max_tokens(body: dict[str, Any], params: dict[str, Any], limit: int | None) -> None:
    """The operator's ceiling on `max_tokens` (a request that omits it gets the engine's default)."""
    if limit is None or params.get("max_tokens", 0) <= limit:
        return
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    raise bad_request(f"Invalid value for '{name}': {params['max_tokens']} is greater than this server's limit "
                      f"of {limit}", param=name, code="max_tokens_exceeded")
