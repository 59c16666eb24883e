"""POST /v1/embeddings: OpenAI's embeddings API over one CALL to the engine's embedding slot.

`input` may be a string, a list of strings, a token array or a list of token arrays (the
shapes the OpenAI SDK, LangChain and LiteLLM send); each becomes one vector. The engine
returns raw little-endian float32 bytes per vector, which is exactly what OpenAI's
`encoding_format: "base64"` carries, so base64 answers are the engine's bytes as they came and
float answers are the same bytes read as numbers: the two formats agree by construction.
"""

from __future__ import annotations

import base64
from typing import Any

import falcon.asgi
import numpy as np

from http_frontend.engine.calls import call_engine
from http_frontend.engine.client import EngineLink
from http_frontend.errors import bad_request
from http_frontend.parsing.body import check_model_name, get_field, read_json_object
from http_frontend.settings import FrontendSettings
from protocol import CallMethod

MAX_INPUTS = 2048  # OpenAI's own limit per request
ENCODING_FORMATS = ("float", "base64")


def _is_token_array(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_input(value: Any) -> list[Any]:
    """`input` as a list of strings or a list of token arrays; 400 for anything else, or for empty input."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and _is_token_array(value):
        items = [value]  # one token array
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request("'input' must be a string, an array of strings, or an array of token arrays",
                          param="input", code="invalid_type")
    if not items:
        raise bad_request("'input' is an empty array; give at least one string or token array", param="input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"'input' may hold at most {MAX_INPUTS} items, got {len(items)}", param="input")
    if all(isinstance(item, str) for item in items):
        for i, item in enumerate(items):
            if not item:
                raise bad_request(f"input[{i}] is an empty string", param="input")
        return items
    if all(_is_token_array(item) for item in items):
        for i, item in enumerate(items):
            if not item:
                raise bad_request(f"input[{i}] is an empty token array", param="input")
            if any(t < 0 or t >= 2**31 for t in item):
                raise bad_request(f"input[{i}] holds a token id outside [0, 2^31)", param="input")
        return items
    raise bad_request("'input' items must all be strings or all be token arrays", param="input", code="invalid_type")


def embedding_object(index: int, raw: bytes, encoding_format: str) -> dict[str, Any]:
    if encoding_format == "base64":
        vector: Any = base64.b64encode(raw).decode("ascii")
    else:
        vector = np.frombuffer(raw, dtype="<f4").tolist()
    return {"object": "embedding", "index": index, "embedding": vector}


class Embeddings:
    """One vector per input, from the engine's embedding model (loaded beside the chat model)."""

    def __init__(self, client: EngineLink, settings: FrontendSettings | None = None):
        self.client = client
        self.settings = settings or FrontendSettings()

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        model = get_field(body, "model", (str,))
        check_model_name(model)
        if "input" not in body or body["input"] is None:
            raise bad_request("Missing required parameter: 'input'", param="input", code="missing_required_parameter")
        inputs = parse_input(body["input"])
        encoding_format = get_field(body, "encoding_format", (str,), default="float")
        if encoding_format not in ENCODING_FORMATS:
            raise bad_request(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}",
                              param="encoding_format")
        dimensions = get_field(body, "dimensions", (int,), minimum=1)
        result = await call_engine(self.client, CallMethod.EMBEDDINGS, self.settings.request_timeout,
                                   {"model": model, "input": inputs, "dimensions": dimensions})
        resp.media = {
            "object": "list",
            "data": [embedding_object(i, raw, encoding_format) for i, raw in enumerate(result["data"])],
            "model": result["model"],
            "usage": {"prompt_tokens": result["prompt_tokens"], "total_tokens": result["prompt_tokens"]},
        }
