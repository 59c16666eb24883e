"""POST /tokenize and /detokenize: the loaded model's tokenizer, asked over a CALL.

`/tokenize` counts a prompt or a chat (rendered by the chat template with its tools,
as the chat route would send it) and reports the context window, so a client can
size a request before sending it. Anthropic's count_tokens route is `CountTokens`.

`GET /tokenizer_info` with `/tokenize` and `/detokenize` is what lm-evaluation-harness's
remote tokenizer asks of a server (vLLM's routes), so an evaluation never downloads one.
"""

from __future__ import annotations

from typing import Annotated, Any

import falcon.asgi
import msgspec

from http_frontend.engine.calls import TOKENIZE_TIMEOUT, call_engine
from http_frontend.engine.client import EngineClient
from http_frontend.errors import bad_request
from http_frontend.parsing.body import check_model_name, get_field, read_json_object
from http_frontend.parsing.generation_fields import check_template_kwargs, parse_tools
from http_frontend.parsing.messages import check_message_count, parse_messages
from http_frontend.settings import FrontendSettings
from protocol import CallMethod

# Token ids as msgpack carries them (64-bit; the engine checks the vocabulary itself), and as a prompt takes them.
TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=-2**63, le=2**63 - 1)]]
PROMPT_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]]


def is_token_ids(value: Any, ids_type: Any = TOKEN_IDS) -> bool:
    """A list of integer token ids (never booleans) within 64 bits (`ids_type`'s bounds).

    msgspec checks types and bounds in one pass in C: a Python walk over a 13 MB body's 6.5 M ids
    took ~0.7 s of its worker's GIL, twice per completion (`parse_prompts`), beside every stream that
    worker serves.
    """
    if not isinstance(value, list):
        return False
    try:
        msgspec.convert(value, ids_type)  # a bool, float, string or an id out of bounds anywhere is refused
    except msgspec.ValidationError:
        return False
    return True


class Tokenize:
    """`{"prompt": str}` or `{"messages": [...]}` -> the loaded model's token ids and context window."""

    def __init__(self, client: EngineClient, settings: FrontendSettings | None = None):
        self.client = client
        self.settings = settings or FrontendSettings()

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        args: dict[str, Any] = {"model": get_field(body, "model", (str,))}
        check_model_name(args["model"])
        if body.get("messages") is not None:
            if body.get("prompt") is not None:
                raise bad_request("Give either 'prompt' or 'messages', not both", param="prompt")
            check_message_count(body, self.settings.max_messages)
            args["messages"] = parse_messages(body)
            args["chat_template_kwargs"] = get_field(body, "chat_template_kwargs", (dict,))
            check_template_kwargs(args["chat_template_kwargs"])
            args["tools"] = parse_tools(body)  # counted as the chat route would render them
        else:
            args["prompt"] = get_field(body, "prompt", (str,), required=True)
        add_special_tokens = get_field(body, "add_special_tokens", (bool,))
        if add_special_tokens is not None:  # absent: the tokenizer's own rules, as a completion's prompt gets
            args["add_special_tokens"] = add_special_tokens
        result = await call_engine(self.client, CallMethod.TOKENIZE, TOKENIZE_TIMEOUT, args)
        resp.media = {"tokens": result["tokens"], "count": result["count"],
                      "max_model_len": result["max_model_len"]}


class Detokenize:
    """`{"tokens": [ids]}` -> `{"prompt": text}` with the loaded model's tokenizer."""

    def __init__(self, client: EngineClient, settings: FrontendSettings | None = None):
        self.client = client
        self.settings = settings or FrontendSettings()

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        tokens = get_field(body, "tokens", (list,), required=True)
        if not is_token_ids(tokens):
            raise bad_request("Invalid 'tokens': expected an array of integers", param="tokens", code="invalid_type")
        args = {"model": get_field(body, "model", (str,)), "tokens": tokens}
        check_model_name(args["model"])
        result = await call_engine(self.client, CallMethod.DETOKENIZE, TOKENIZE_TIMEOUT, args)
        resp.media = {"prompt": result["prompt"]}


# What `GET /tokenizer_info` answers: the engine's fields by name, so nothing else it may send is passed on.
TOKENIZER_INFO_FIELDS = (
    "eos_token", "bos_token", "pad_token", "unk_token", "eos_token_id", "bos_token_id", "pad_token_id",
    "add_bos_token", "add_eos_token", "chat_template", "model_max_length", "vocab_size", "tokenizer_class",
)


class TokenizerInfo:
    """`GET /tokenizer_info[?model=name]` -> the loaded tokenizer's special tokens, chat template and limits.

    vLLM's route of the same name: lm-evaluation-harness reads `eos_token` (and `bos_token`,
    `pad_token`, `chat_template`) from it, then their ids through `/tokenize`. The engine answers it
    on the TOKENIZE CALL, so `model` resolves as there: unknown -> 404, another model's -> 400.
    """

    def __init__(self, client: EngineClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        model = req.get_param("model")
        check_model_name(model)
        args = {"model": model, "tokenizer_info": True}
        result = await call_engine(self.client, CallMethod.TOKENIZE, TOKENIZE_TIMEOUT, args)
        resp.media = {name: result.get(name) for name in TOKENIZER_INFO_FIELDS}
