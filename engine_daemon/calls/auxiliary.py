"""Auxiliary CALLs checked on the io thread: each becomes an `AuxiliaryRequest` for the mlx thread.

Only cheap shape checks happen here (no tokenizing, no decoding: those are client-sized
and run in the job's `prepare` on the admission pool). The front-end checks the same
shapes; these checks keep a hand-made frame from reaching the mlx thread.
"""

from __future__ import annotations

from typing import Any

from engine_daemon.auxiliary.jobs import AuxiliaryRequest
from engine_daemon.config import MAX_NAME_BYTES
from engine_daemon.errors import RequestError

# OpenAI's own limit of inputs per embeddings request.
MAX_EMBEDDING_INPUTS = 2048


def _model_name(args: dict[str, Any]) -> str | None:
    model = args.get("model")
    if model is not None and (not isinstance(model, str) or len(model.encode("utf-8", "surrogatepass"))
                              > MAX_NAME_BYTES):
        raise RequestError(400, "invalid_value", "'model' must be a model name", param="model")
    return model


def embeddings(ctx: Any, args: dict[str, Any]) -> AuxiliaryRequest:
    """{"model", "input": [str, ...] | [[int, ...], ...], "dimensions"} -> the embedding job's request."""
    inputs = args.get("input")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError(400, "invalid_value", "'input' must be a non-empty array", param="input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise RequestError(400, "invalid_value", f"'input' may hold at most {MAX_EMBEDDING_INPUTS} items",
                           param="input")
    if all(isinstance(item, str) for item in inputs):
        empty = next((i for i, item in enumerate(inputs) if not item), None)
        if empty is not None:
            raise RequestError(400, "invalid_value", f"input[{empty}] is an empty string", param="input")
    elif all(isinstance(item, list) for item in inputs):
        for i, item in enumerate(inputs):
            if not item:
                raise RequestError(400, "invalid_value", f"input[{i}] is an empty token array", param="input")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in item):
                raise RequestError(400, "invalid_type", f"input[{i}] must hold non-negative integer token ids",
                                   param="input")
    else:
        raise RequestError(400, "invalid_type", "'input' must be strings or token arrays, not a mix", param="input")
    dimensions = args.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        raise RequestError(400, "invalid_value", "'dimensions' must be a positive integer", param="dimensions")
    return AuxiliaryRequest("embedding", _model_name(args), {"input": inputs, "dimensions": dimensions})
