"""The OpenAPI description of the auxiliary models' routes: /v1/embeddings (and the audio routes).

Kept apart from `openapi` so each auxiliary route's schema sits in one short place; `openapi`
merges `AUXILIARY_SCHEMAS` and `auxiliary_paths` into the document (it passes its own
operation builders in, so this module imports nothing of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Schema = dict[str, Any]
STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
TOKEN_ARRAY: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

EMBEDDINGS_REQUEST: Schema = {"type": "object", "required": ["input"], "properties": {
    "model": STRING,
    "input": {"oneOf": [{"type": "string", "minLength": 1},
                        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 2048},
                        TOKEN_ARRAY, {"type": "array", "items": TOKEN_ARRAY, "minItems": 1, "maxItems": 2048}]},
    "encoding_format": {"type": "string", "enum": ["float", "base64"]},
    "dimensions": {"type": "integer", "minimum": 1},
    "user": STRING}}
EMBEDDINGS_RESPONSE: Schema = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"type": "string", "enum": ["list"]},
    "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"], "properties": {
        "object": {"type": "string", "enum": ["embedding"]}, "index": INTEGER,
        # base64: the little-endian float32 bytes of the vector
        "embedding": {"oneOf": [{"type": "array", "items": NUMBER}, STRING]}}}},
    "model": STRING,
    "usage": {"type": "object", "properties": {"prompt_tokens": INTEGER, "total_tokens": INTEGER}}}}

AUXILIARY_SCHEMAS: dict[str, Schema] = {"EmbeddingsRequest": EMBEDDINGS_REQUEST, "Embeddings": EMBEDDINGS_RESPONSE}


def auxiliary_paths(operation: Callable[..., dict[str, Any]], ok: Callable[[Schema], dict[str, Any]],
                    ref: Callable[[str], Schema]) -> dict[str, Any]:
    """The auxiliary routes' path items, built with the document's own `operation` / `ok` / `ref`."""
    return {
        "/v1/embeddings": {"post": operation(
            "Vectors of strings or token arrays from the embedding model (loaded beside the chat model)",
            "EmbeddingsRequest", ok(ref("Embeddings")), (400, 401, 404, 413, 503, 504))},
    }
