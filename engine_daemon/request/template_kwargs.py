"""`chat_template_kwargs`: the extra variables a client may hand the model's chat template.

They reach `apply_chat_template` as keyword arguments, which also takes arguments that
change what it *does*: `tokenize=False` made a string prompt that failed the next batch
step for every client, `return_tensors` likewise, and `chat_template` rendered a
client's Jinja on the mlx thread with no budget (a 200-byte loop froze every stream for
69 s). So only plain JSON values pass, bounded in size and depth, and the names that
steer the call itself are refused with a 400 that names them.
"""

from __future__ import annotations

import math
from typing import Any

from engine_daemon.errors import RequestError

# Keyword arguments of `apply_chat_template` (transformers, mlx-lm, mlx-vlm) that are not
# template variables. `tools` and `documents` come from the request's own fields.
RESERVED = frozenset({
    "add_generation_prompt", "chat_template", "continue_final_message", "conversation", "documents",
    "max_length", "messages", "padding", "processor_kwargs", "return_assistant_tokens_mask", "return_dict",
    "return_tensors", "tokenize", "tokenizer_kwargs", "tools", "truncation",
})
# `--allow-request-chat-template`: then `chat_template` passes (rendered by `client_template.render`).
allow_request_template = False
MAX_DEPTH = 8
MAX_ITEMS = 1024  # values counted over the whole tree
MAX_STRING = 65536  # characters of one string


def checked_template_kwargs(raw: Any) -> dict[str, Any]:
    """The request's template variables, or RequestError naming what is not allowed."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _invalid("'chat_template_kwargs' must be an object")
    reserved = sorted(name for name in raw if name in RESERVED
                      and not (name == "chat_template" and allow_request_template))
    if reserved:
        raise _invalid(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: these are arguments "
                       "of the template call, not template variables")
    budget = [MAX_ITEMS]
    for key, value in raw.items():
        if not isinstance(key, str):
            raise _invalid("chat_template_kwargs keys must be strings")
        _check_value(value, 1, budget)
    return dict(raw)


def configure(allow_template: bool) -> None:
    """Set once at start from `--allow-request-chat-template`."""
    global allow_request_template
    allow_request_template = allow_template


def _check_value(value: Any, depth: int, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise _invalid(f"chat_template_kwargs holds more than {MAX_ITEMS} values")
    if depth > MAX_DEPTH:
        raise _invalid(f"chat_template_kwargs is nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -2**63 <= value < 2**64:
            raise _invalid("chat_template_kwargs integers must fit in 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _invalid("chat_template_kwargs numbers must be finite")
        return
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise _invalid(f"chat_template_kwargs strings are limited to {MAX_STRING} characters")
        return
    if isinstance(value, list):
        for item in value:
            _check_value(item, depth + 1, budget)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _invalid("chat_template_kwargs keys must be strings")
            _check_value(item, depth + 1, budget)
        return
    raise _invalid(f"chat_template_kwargs values must be JSON values, not {type(value).__name__}")


def _invalid(message: str) -> RequestError:
    return RequestError(400, "invalid_value", message, param="chat_template_kwargs")
