"""The OpenAPI description of the tokenizer routes: /v1/tokenize, /v1/detokenize, /v1/tokenizer_info.

Kept apart from `openapi` (which would otherwise pass its length limit); `openapi` merges
`TOKEN_SCHEMAS` and `token_paths` into the document and passes its own operation builders in,
so this module imports nothing of it. The tokenize request (messages, tools) stays there, beside
the chat schemas it is made of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from http_frontend.service.openapi_schema import BOOLEAN, INTEGER, STRING, Schema, arr, nullable, obj

TOKENIZE_RESULT = obj({"tokens": arr(INTEGER), "count": INTEGER, "max_model_len": nullable(INTEGER)},
                      ("tokens", "count"))
DETOKENIZE_REQUEST = obj({"model": STRING, "tokens": arr({"type": "integer", "minimum": 0})}, ("tokens",))
DETOKENIZE_RESULT = obj({"prompt": STRING}, ("prompt",))
# vLLM's /tokenizer_info names (what lm-evaluation-harness's remote tokenizer reads), a fixed set of fields
TOKENIZER_INFO = obj({
    "eos_token": nullable(STRING), "bos_token": nullable(STRING), "pad_token": nullable(STRING),
    "unk_token": nullable(STRING), "eos_token_id": nullable(INTEGER), "bos_token_id": nullable(INTEGER),
    "pad_token_id": nullable(INTEGER),
    "add_bos_token": BOOLEAN, "add_eos_token": BOOLEAN,  # what `add_special_tokens: true` adds to a prompt
    "chat_template": nullable(STRING), "model_max_length": nullable(INTEGER), "vocab_size": INTEGER,
    "tokenizer_class": STRING,
}, ("eos_token", "bos_token", "pad_token", "chat_template"))

TOKEN_SCHEMAS: dict[str, Schema] = {
    "TokenizeResult": TOKENIZE_RESULT, "DetokenizeRequest": DETOKENIZE_REQUEST, "DetokenizeResult": DETOKENIZE_RESULT,
    "TokenizerInfo": TOKENIZER_INFO,
}
MODEL_QUERY = [{"name": "model", "in": "query", "required": False, "schema": STRING}]


def token_paths(operation: Callable[..., dict[str, Any]], ok: Callable[[Schema], dict[str, Any]],
                ref: Callable[[str], Schema], call_errors: tuple[int, ...]) -> dict[str, Any]:
    """The tokenizer routes' path items, built with the document's own `operation` / `ok` / `ref`."""
    return {
        "/v1/tokenize": {"post": operation(
            "Token ids of a prompt or of templated chat messages (`add_special_tokens`: a prompt's BOS/EOS, "
            "by the tokenizer's rules when absent)", "TokenizeRequest", ok(ref("TokenizeResult")),
            call_errors + (404, 413))},
        "/v1/detokenize": {"post": operation("Text of token ids", "DetokenizeRequest", ok(ref("DetokenizeResult")),
                                             call_errors + (404, 413))},
        "/v1/tokenizer_info": {"get": {**operation(
            "The loaded model's tokenizer: special tokens, chat template, limits (vLLM's route); `model` "
            "resolves as for /v1/tokenize", None, ok(ref("TokenizerInfo")), call_errors + (404,)),
            "parameters": MODEL_QUERY}},
    }
