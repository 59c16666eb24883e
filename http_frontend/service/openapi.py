"""GET /openapi.json: an OpenAPI 3 description of every route this front-end serves.

Written by hand from the validators' limits and kept true by `tests.test_openapi` (every route described;
Schemathesis against a live server: no 5xx, every response as written here). Each /v1 route also answers
without the prefix; only the /v1 spelling is listed. Auxiliary routes (embeddings, audio): `openapi_auxiliary`;
the tokenizer routes: `openapi_tokens`.
"""

from __future__ import annotations

from typing import Any

import falcon.asgi

from http_frontend.service.openapi_audio import AUDIO_PATHS, AUDIO_SCHEMAS
from http_frontend.service.openapi_auxiliary import AUXILIARY_SCHEMAS, auxiliary_paths
from http_frontend.service.openapi_schema import (
    ANY_OBJECT,
    BOOLEAN,
    INTEGER,
    NUMBER,
    STRING,
    Schema,
    arr,
    nullable,
    obj,
    ref,
)
from http_frontend.service.openapi_tokens import TOKEN_SCHEMAS, token_paths

ERROR = obj({"error": obj({"message": STRING, "type": STRING, "param": nullable(STRING),
                           "code": nullable(STRING)}, ("message", "type"))}, ("error",))
ANTHROPIC_ERROR = obj({"type": {"type": "string", "enum": ["error"]},
                       "error": obj({"type": STRING, "message": STRING}, ("type", "message"))}, ("type", "error"))

TEXT_PART = obj({"type": {"type": "string", "enum": ["text", "input_text"]}, "text": STRING}, ("type", "text"))
IMAGE_PART = obj({"type": {"type": "string", "enum": ["image_url"]},
                  "image_url": obj({"url": STRING, "detail": STRING}, ("url",))}, ("type", "image_url"))
AUDIO_PART = obj({"type": {"type": "string", "enum": ["input_audio"]},
                  "input_audio": obj({"data": STRING, "format": STRING}, ("data",))}, ("type", "input_audio"))
TOOL_CALL = obj({"id": STRING, "type": {"type": "string", "enum": ["function"]},
                 "function": obj({"name": STRING, "arguments": STRING}, ("name", "arguments"))},
                ("id", "type", "function"))
MESSAGE = obj({
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": nullable({"oneOf": [STRING, arr({"oneOf": [TEXT_PART, IMAGE_PART, AUDIO_PART]})]}),
    "name": STRING, "tool_calls": arr(TOOL_CALL), "tool_call_id": STRING, "reasoning_content": STRING,
}, ("role",))
TOOL = obj({"type": {"type": "string", "enum": ["function"]},
            "function": obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,64}$"},
                             "description": STRING, "parameters": ANY_OBJECT, "strict": BOOLEAN}, ("name",))},
           ("type", "function"))
HOSTED_TOOL = {**obj({"type": {"type": "string", "enum": [
    "web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
    "local_shell", "image_generation", "mcp", "tool_search"]}}, ("type",)),
    "description": "Hosted tools: left out of the prompt and named in the X-Ignored-Tools header"}
TOOL_CHOICE_MODE = obj({"type": {"type": "string", "enum": ["none", "auto", "required", "any"]}}, ("type",))
ALLOWED_TOOLS = obj({"type": {"type": "string", "enum": ["allowed_tools"]},
                     "allowed_tools": obj({"mode": {"type": "string", "enum": ["auto", "required"]},
                                           "tools": arr(ANY_OBJECT)}, ("mode", "tools"))}, ("type", "allowed_tools"))
TOOL_CHOICE = {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, TOOL_CHOICE_MODE,
                         obj({"type": {"type": "string", "enum": ["function"]},
                              "function": obj({"name": STRING}, ("name",))}, ("type", "function")), ALLOWED_TOOLS]}
RESPONSE_FORMAT = obj({"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                       "json_schema": obj({"name": STRING, "schema": ANY_OBJECT, "strict": BOOLEAN})}, ("type",))
TEMPLATE_KWARGS = {**ANY_OBJECT, "description": (
    "Chat template variables. The template call's own arguments (tokenize, return_tensors, return_dict, tools, "
    "documents, add_generation_prompt, continue_final_message, padding, truncation, max_length, conversation, "
    "messages, tokenizer_kwargs, processor_kwargs, return_assistant_tokens_mask) are refused with a 400; "
    "chat_template only when the engine runs with --allow-request-chat-template.")}
STOP_STRING = {"type": "string", "maxLength": 1024}  # `MAX_STOP_LENGTH`; at most `MAX_STOP_STRINGS` of them
STOP = {"oneOf": [STOP_STRING, arr(STOP_STRING, maxItems=16)]}

SAMPLING: dict[str, Schema] = {
    "model": STRING,
    "max_tokens": nullable({"type": "integer", "minimum": 1}),
    "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "top_k": nullable({"type": "integer", "minimum": -1}),
    "min_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "repetition_penalty": nullable({"type": "number", "minimum": 0.01}),
    "presence_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "logit_bias": nullable({"type": "object", "additionalProperties": {"type": "number", "minimum": -100,
                                                                          "maximum": 100}}),
    "seed": nullable(INTEGER),
    "stop": nullable(STOP),
    "n": nullable({"type": "integer", "minimum": 1, "maximum": 16}),
    "stream": nullable(BOOLEAN),
    "stream_options": nullable(obj({"include_usage": BOOLEAN})),
    "ignore_eos": nullable(BOOLEAN),
    "min_tokens": nullable({"type": "integer", "minimum": 0}),
    "user": nullable(STRING),
    "response_format": nullable(RESPONSE_FORMAT),
}

CHAT_REQUEST = obj({
    **SAMPLING,
    "messages": arr(MESSAGE, minItems=1),
    "max_completion_tokens": nullable({"type": "integer", "minimum": 1}),
    "adapter_path": nullable(STRING),  # LoRA adapter: a registered name or a directory under --model-dir
    "logprobs": nullable(BOOLEAN),
    "top_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": 20}),
    "tools": nullable(arr({"oneOf": [TOOL, HOSTED_TOOL]}, maxItems=128)),
    "tool_choice": nullable(TOOL_CHOICE),
    "parallel_tool_calls": nullable(BOOLEAN),
    "chat_template_kwargs": nullable(TEMPLATE_KWARGS),
    "enable_thinking": nullable(BOOLEAN),
    "thinking_budget": nullable({"type": "integer", "minimum": 0}),
    "reasoning_effort": nullable({"type": "string", "enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}),
}, ("messages",))

COMPLETION_REQUEST = obj({
    **SAMPLING,
    "prompt": {"oneOf": [{"type": "string", "minLength": 1}, arr({"type": "integer", "minimum": 0}, minItems=1),
                         arr({"type": "string", "minLength": 1}, minItems=1, maxItems=64),
                         arr(arr({"type": "integer", "minimum": 0}, minItems=1), minItems=1, maxItems=64)]},
    "echo": nullable(BOOLEAN),
    "max_tokens": nullable({"type": "integer", "minimum": 0}),  # 0: with `echo` and `logprobs`, the prompt's only
    "adapter_path": nullable(STRING),
    "suffix": nullable({"type": "string", "maxLength": 0}),
    "best_of": nullable({"type": "integer", "minimum": 1, "maximum": 1}),
    "logprobs": {"type": "integer", "nullable": True, "minimum": 0, "maximum": 20},
}, ("prompt",))

USAGE = nullable(obj({"prompt_tokens": INTEGER, "completion_tokens": INTEGER, "total_tokens": INTEGER,
                      "prompt_tokens_details": obj({"cached_tokens": INTEGER}),
                      "completion_tokens_details": obj({"reasoning_tokens": INTEGER}),
                      "context_overflow": ANY_OBJECT},
                     ("prompt_tokens", "completion_tokens", "total_tokens")))
FINISH_REASON = nullable({"type": "string", "enum": ["stop", "length", "tool_calls", "content_filter"]})
LOGPROB_ENTRY = obj({"token": STRING, "logprob": NUMBER, "bytes": nullable(arr(INTEGER)),
                     "top_logprobs": arr(obj({"token": STRING, "logprob": NUMBER, "bytes": nullable(arr(INTEGER))}))},
                    ("token", "logprob"))
CHAT_COMPLETION = obj({
    "id": STRING, "object": {"type": "string", "enum": ["chat.completion"]}, "created": INTEGER, "model": STRING,
    "choices": arr(obj({
        "index": INTEGER,
        "message": obj({"role": {"type": "string", "enum": ["assistant"]}, "content": nullable(STRING),
                        "reasoning_content": STRING, "reasoning": STRING, "tool_calls": arr(TOOL_CALL)},
                       ("role",)),
        "logprobs": nullable(obj({"content": arr(LOGPROB_ENTRY)})),
        "finish_reason": FINISH_REASON}, ("index", "message", "finish_reason"))),
    "usage": USAGE,
}, ("id", "object", "created", "model", "choices"))
TEXT_COMPLETION = obj({
    "id": STRING, "object": {"type": "string", "enum": ["text_completion"]}, "created": INTEGER, "model": STRING,
    "choices": arr(obj({"index": INTEGER, "text": STRING, "logprobs": nullable(ANY_OBJECT),
                        "finish_reason": FINISH_REASON}, ("index", "text", "finish_reason"))),
    "usage": USAGE,
}, ("id", "object", "created", "model", "choices"))

RESPONSES_INPUT_ITEM = obj({"type": STRING, "role": STRING, "content": {"oneOf": [STRING, arr(ANY_OBJECT)]},
                            "call_id": STRING, "name": STRING, "namespace": STRING, "arguments": STRING,
                            "input": STRING, "output": {"oneOf": [STRING, arr(ANY_OBJECT)]},
                            "tools": arr(ANY_OBJECT), "action": ANY_OBJECT, "encrypted_content": STRING})
RESPONSES_FUNCTION_TOOL = obj({"type": {"type": "string", "enum": ["function"]}, "name": STRING,
                               "description": STRING, "parameters": ANY_OBJECT, "strict": BOOLEAN}, ("type", "name"))
RESPONSES_CUSTOM_TOOL = obj({"type": {"type": "string", "enum": ["custom"]}, "name": STRING, "description": STRING,
                             "format": obj({"type": {"type": "string", "enum": ["text", "grammar"]},
                                            "syntax": {"type": "string", "enum": ["lark", "regex"]},
                                            "definition": STRING}, ("type",))}, ("type", "name"))
RESPONSES_TOOL = {"oneOf": [
    RESPONSES_FUNCTION_TOOL, RESPONSES_CUSTOM_TOOL,
    obj({"type": {"type": "string", "enum": ["namespace"]}, "name": STRING, "description": STRING,
         "tools": arr({"oneOf": [RESPONSES_FUNCTION_TOOL, RESPONSES_CUSTOM_TOOL]})}, ("type", "name", "tools")),
    HOSTED_TOOL,
]}
RESPONSES_REQUEST = obj({
    "model": STRING,
    "input": {"oneOf": [STRING, arr(RESPONSES_INPUT_ITEM, minItems=1)]},
    "instructions": nullable(STRING),
    "max_output_tokens": nullable({"type": "integer", "minimum": 1}),
    "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "stream": nullable(BOOLEAN),
    "store": nullable(BOOLEAN),
    "previous_response_id": nullable(STRING),
    "tools": nullable(arr(RESPONSES_TOOL)),
    "tool_choice": nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, TOOL_CHOICE_MODE,
                                       obj({"type": {"type": "string", "enum": ["function", "custom"]},
                                            "name": STRING, "namespace": STRING}, ("type", "name")),
                                       obj({"type": {"type": "string", "enum": ["allowed_tools"]},
                                            "mode": {"type": "string", "enum": ["auto", "required"]},
                                            "tools": arr(ANY_OBJECT)}, ("type",))]}),
    "text": nullable(obj({"format": obj({"type": {"type": "string",
                                                  "enum": ["text", "json_object", "json_schema"]},
                                         "name": STRING, "schema": ANY_OBJECT, "strict": BOOLEAN}, ("type",))})),
    "reasoning": nullable(obj({"effort": nullable(STRING), "summary": nullable(STRING)})),
    "include": nullable(arr(STRING)), "top_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": 20}),
}, ("input",))
RESPONSE_OBJECT = obj({
    "id": STRING, "object": {"type": "string", "enum": ["response"]}, "created_at": NUMBER, "status": STRING,
    "model": STRING, "output": arr(obj({"type": STRING, "id": STRING}, ("type",))),
    "usage": nullable(obj({"input_tokens": INTEGER, "output_tokens": INTEGER, "total_tokens": INTEGER},
                          ("input_tokens", "output_tokens", "total_tokens"))),
}, ("id", "object", "status", "output"))
RESPONSE_DELETED = obj({"id": STRING, "object": STRING, "deleted": BOOLEAN}, ("id", "deleted"))

ANTHROPIC_BLOCK = obj({"type": STRING, "text": STRING, "thinking": STRING, "signature": STRING,
                       "source": {"oneOf": [ANY_OBJECT, STRING]}, "id": STRING, "name": STRING,  # str: search_result
                       "input": ANY_OBJECT, "tool_use_id": STRING,
                       "content": {"oneOf": [STRING, arr(ANY_OBJECT)]},
                       # `document` blocks (text, content or base64 PDF sources become text)
                       "title": STRING, "context": STRING, "citations": ANY_OBJECT, "cache_control": ANY_OBJECT},
                      ("type",))
# `system` turns inside `messages`: Claude Code's mid-conversation system messages.
ANTHROPIC_MESSAGE_PARAM = obj({"role": {"type": "string", "enum": ["user", "assistant", "system"]},
                               "content": {"oneOf": [STRING, arr(ANTHROPIC_BLOCK)]}}, ("role", "content"))
# `strict`: a forced call follows `input_schema`, objects closed, `required` as written (Anthropic's strict).
ANTHROPIC_TOOL = obj({"name": STRING, "description": STRING, "input_schema": ANY_OBJECT, "strict": BOOLEAN},
                     ("name",))
ANTHROPIC_COMMON: dict[str, Schema] = {
    "model": STRING,
    "messages": arr(ANTHROPIC_MESSAGE_PARAM, minItems=1),
    "system": {"oneOf": [STRING, arr(obj({"type": STRING, "text": STRING}, ("type", "text")))]},
    "tools": arr({"oneOf": [ANTHROPIC_TOOL, {
        **obj({"type": STRING, "name": STRING}, ("type", "name")),
        "description": "Anthropic's tools by type: client tools (bash_*, text_editor_*, memory_20250818) offered "
                       "with their documented input; hosted ones (web_search_20250305, …) left out, named in "
                       "X-Ignored-Tools"}]}),
    "context_management": ANY_OBJECT,
    "output_config": obj({"effort": STRING, "format": ANY_OBJECT}),
    "tool_choice": obj({"type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": STRING,
                        "disable_parallel_tool_use": BOOLEAN}, ("type",)),
    "thinking": obj({"type": {"type": "string", "enum": ["enabled", "disabled", "adaptive"]},
                     "budget_tokens": {"type": "integer", "minimum": 0}}, ("type",)),
}
ANTHROPIC_REQUEST = obj({
    **ANTHROPIC_COMMON,
    "max_tokens": {"type": "integer", "minimum": 1},
    "stop_sequences": arr(STOP_STRING, maxItems=16),
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "stream": BOOLEAN,
    "metadata": ANY_OBJECT,
}, ("model", "messages", "max_tokens"))
ANTHROPIC_COUNT_REQUEST = obj(ANTHROPIC_COMMON, ("model", "messages"))
ANTHROPIC_MESSAGE = obj({
    "id": STRING, "type": {"type": "string", "enum": ["message"]},
    "role": {"type": "string", "enum": ["assistant"]}, "model": STRING, "content": arr(ANTHROPIC_BLOCK),
    "stop_reason": nullable({"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]}),
    "stop_sequence": nullable(STRING),
    "usage": obj({"input_tokens": INTEGER, "output_tokens": INTEGER, "cache_read_input_tokens": INTEGER,
                  "cache_creation_input_tokens": INTEGER}, ("input_tokens", "output_tokens")),
}, ("id", "type", "role", "content", "stop_reason", "usage"))

MODEL_TYPE = {"type": "string", "enum": ["text", "vision", "audio", "embedding", "transcription", "speech"]}
MODEL = obj({"id": STRING, "object": {"type": "string", "enum": ["model"]}, "created": INTEGER, "owned_by": STRING,
             "context_window": nullable(INTEGER), "type": MODEL_TYPE, "kind": MODEL_TYPE, "loaded": BOOLEAN},
            ("id", "object"))
HEALTH = obj({"status": {"type": "string", "enum": ["healthy", "stalled", "unhealthy"]},
              "loaded_model": nullable(STRING), "loaded_adapter": nullable(STRING), "engine": ANY_OBJECT,
              "error": STRING}, ("status",))
ADAPTER_NAME_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"}
ADAPTER = obj({"id": STRING, "object": {"type": "string", "enum": ["adapter"]}, "path": STRING, "default": BOOLEAN},
              ("id", "object"))
ADAPTER_REGISTRATION = obj({"name": ADAPTER_NAME_SCHEMA, "path": {"type": "string", "minLength": 1}},
                           ("name", "path"))
ADAPTER_DELETED = obj({"id": STRING, "object": STRING, "deleted": BOOLEAN}, ("id", "deleted"))
TOKENIZE_REQUEST = obj({"model": STRING, "prompt": STRING, "messages": arr(MESSAGE, minItems=1),
                        "chat_template_kwargs": TEMPLATE_KWARGS, "tools": arr(TOOL), "add_special_tokens": BOOLEAN})

SCHEMAS: dict[str, Schema] = {
    "Error": ERROR, "AnthropicError": ANTHROPIC_ERROR,
    "ChatCompletionRequest": CHAT_REQUEST, "ChatCompletion": CHAT_COMPLETION,
    "CompletionRequest": COMPLETION_REQUEST, "Completion": TEXT_COMPLETION,
    "ResponsesRequest": RESPONSES_REQUEST, "Response": RESPONSE_OBJECT, "ResponseDeleted": RESPONSE_DELETED,
    "MessagesRequest": ANTHROPIC_REQUEST, "Message": ANTHROPIC_MESSAGE,
    "CountTokensRequest": ANTHROPIC_COUNT_REQUEST,
    "Model": MODEL, "Health": HEALTH, **AUXILIARY_SCHEMAS, **AUDIO_SCHEMAS,
    "Adapter": ADAPTER, "AdapterRegistration": ADAPTER_REGISTRATION, "AdapterDeleted": ADAPTER_DELETED,
    "TokenizeRequest": TOKENIZE_REQUEST, **TOKEN_SCHEMAS,
}

CHAT_CHUNK = obj({
    "id": STRING, "object": {"type": "string", "enum": ["chat.completion.chunk"]}, "created": INTEGER,
    "model": STRING,
    "choices": arr(obj({
        "index": INTEGER,
        "delta": obj({"role": STRING, "content": nullable(STRING), "reasoning_content": STRING, "reasoning": STRING,
                      "tool_calls": arr(obj({"index": INTEGER, "id": STRING, "type": STRING,
                                             "function": obj({"name": STRING, "arguments": STRING})},
                                            ("index",)))}),
        "logprobs": nullable(obj({"content": arr(LOGPROB_ENTRY)})),
        "finish_reason": FINISH_REASON}, ("index", "delta"))),
    "usage": USAGE,
}, ("id", "object", "created", "model", "choices"))
COMPLETION_CHUNK = obj({
    "id": STRING, "object": {"type": "string", "enum": ["text_completion"]}, "created": INTEGER, "model": STRING,
    "choices": arr(obj({"index": INTEGER, "text": STRING, "finish_reason": FINISH_REASON}, ("index", "text"))),
    "usage": USAGE,
}, ("id", "object", "created", "model", "choices"))
RESPONSES_EVENT = obj({"type": STRING, "sequence_number": INTEGER}, ("type", "sequence_number"))
ANTHROPIC_EVENT = obj({"type": STRING}, ("type",))


def sse(event: Schema) -> dict[str, Any]:
    """Server-Sent Events whose `data` is JSON matching `event` (or the `[DONE]` marker)."""
    data = {"anyOf": [{"type": "string", "enum": ["[DONE]"]},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": event}]}
    return {"text/event-stream": {"schema": obj({"event": STRING, "id": STRING, "data": data})}}


def _json(schema: Schema) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(statuses: tuple[int, ...], anthropic: bool = False) -> dict[str, Any]:
    schema = ref("AnthropicError" if anthropic else "Error")
    return {str(status): {"description": DESCRIPTIONS[status], "content": _json(schema)} for status in statuses}


DESCRIPTIONS = {
    400: "Invalid request: the error names the offending `param`.",
    401: "Missing or wrong API key (when the server has keys).",
    404: "Unknown model or object.",
    409: "Conflict: the name is already taken.",
    405: "Method not allowed on this route.",
    413: "Request body too large.",
    429: "The engine's queue is full; retry after `Retry-After` seconds.",
    503: "The engine is unreachable, loading or stalled; retry after `Retry-After` seconds.",
    504: "The engine did not answer in time.",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503, 504)
CALL_ERRORS = (400, 401, 503, 504)


def _operation(summary: str, request: str | None, responses: dict[str, Any], errors: tuple[int, ...],
               anthropic: bool = False) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": {**responses, **_errors(errors, anthropic)}}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": _json(ref(request))}
    return operation


def _ok(schema: Schema, events: Schema | None = None) -> dict[str, Any]:
    """200 with a JSON body, and with an SSE body of `events` when the route streams."""
    streams = events is not None
    content = _json(schema)
    if events is not None:
        content.update(sse(events))
    return {"200": {"description": "Success" + (" (JSON, or Server-Sent Events with `stream: true`)"
                                                if streams else ""), "content": content}}


RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": STRING}]
# The route is /v1/models/{model_id:path}: an id may hold slashes (org/name), sent as is or as %2F.
MODEL_ID = [{"name": "model_id", "in": "path", "required": True, "schema": STRING}]
ADAPTER_NAME = [{"name": "name", "in": "path", "required": True, "schema": STRING}]
ENGINE_ID = [{"name": "engine_id", "in": "path", "required": True, "schema": STRING}]


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.0 document (plain data, built once per worker)."""
    paths = {
        "/v1/chat/completions": {"post": _operation("OpenAI chat completion", "ChatCompletionRequest",
                                                    _ok(ref("ChatCompletion"), {"anyOf": [CHAT_CHUNK, ERROR]}),
                                                    GENERATION_ERRORS)},
        "/v1/completions": {"post": _operation("OpenAI text completion (raw prompt, no chat template)",
                                               "CompletionRequest",
                                               _ok(ref("Completion"), {"anyOf": [COMPLETION_CHUNK, ERROR]}),
                                               GENERATION_ERRORS)},
        "/v1/responses": {"post": _operation("OpenAI Responses API", "ResponsesRequest",
                                             _ok(ref("Response"), RESPONSES_EVENT), GENERATION_ERRORS)},
        "/v1/responses/{response_id}": {
            "get": {**_operation("A stored response (`stream=true`: its events again, after `starting_after`)", None,
                                 _ok(ref("Response"), RESPONSES_EVENT), (400, 401, 404, 503, 504)),
                    "parameters": RESPONSE_ID + [{"name": "stream", "in": "query", "schema": BOOLEAN},
                                                 {"name": "starting_after", "in": "query", "schema": INTEGER}]},
            "delete": {**_operation("Delete a stored response", None, _ok(ref("ResponseDeleted")),
                                    (401, 404, 503, 504)), "parameters": RESPONSE_ID},
        },
        "/v1/responses/{response_id}/input_items": {"get": {
            **_operation("The input items of a stored response", None,
                         _ok(obj({"object": {"type": "string", "enum": ["list"]},
                                  "data": arr(obj({"id": STRING, "type": STRING}, ("id", "type"))),
                                  "first_id": nullable(STRING), "last_id": nullable(STRING), "has_more": BOOLEAN},
                                 ("object", "data", "has_more"))), (400, 401, 404, 503, 504)),
            "parameters": RESPONSE_ID + [
                {"name": "order", "in": "query", "required": False,
                 "schema": {"type": "string", "enum": ["asc", "desc"]}},
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "after", "in": "query", "required": False, "schema": STRING}]}},
        "/v1/responses/{response_id}/cancel": {"post": {
            **_operation("Cancel a background response (none run here: always 400 or 404)", None, {},
                         (400, 401, 404, 503, 504)), "parameters": RESPONSE_ID}},
        "/v1/messages": {"post": _operation("Anthropic Messages API", "MessagesRequest",
                                            _ok(ref("Message"), ANTHROPIC_EVENT), GENERATION_ERRORS, anthropic=True)},
        "/v1/messages/count_tokens": {"post": _operation(
            "Anthropic token counting", "CountTokensRequest",
            _ok(obj({"input_tokens": INTEGER}, ("input_tokens",))), (400, 401, 404, 413, 503, 504), anthropic=True)},
        **auxiliary_paths(_operation, _ok, ref),  # /v1/embeddings and the other auxiliary models' routes
        **token_paths(_operation, _ok, ref, CALL_ERRORS),  # /v1/tokenize, /v1/detokenize, /v1/tokenizer_info
        "/v1/models": {"get": _operation("MLX models this engine can serve", None,
                                         _ok(obj({"object": {"type": "string", "enum": ["list"]},
                                                  "data": arr(ref("Model"))}, ("object", "data"))), CALL_ERRORS)},
        "/v1/models/{model_id}": {"get": {**_operation("One model of the catalogue, or a name a chat is served under "
                                                       "(fallback, glob alias); unknown → 404 model_not_found",
                                                       None, _ok(ref("Model")), (401, 404, 503, 504)),
                                          "parameters": MODEL_ID}},
        "/v1/adapters": {
            "get": _operation("LoRA adapters registered with the engine", None,
                              _ok(obj({"object": {"type": "string", "enum": ["list"]}, "data": arr(ref("Adapter"))},
                                      ("object", "data"))), CALL_ERRORS),
            "post": _operation("Register a LoRA adapter directory (under the engine's --model-dir) by name",
                               "AdapterRegistration", _ok(ref("Adapter")), (400, 401, 404, 409, 413, 503, 504)),
        },
        "/v1/adapters/{name}": {"delete": {**_operation("Unregister a LoRA adapter", None, _ok(ref("AdapterDeleted")),
                                                        (400, 401, 404, 503, 504)), "parameters": ADAPTER_NAME}},
        "/health": {"get": {"summary": "Liveness of the engine behind this front-end", "responses": {
            "200": {"description": "The engine answers and is not stalled", "content": _json(ref("Health"))},
            "503": {"description": "The engine is unreachable or stalled", "content": _json(ref("Health"))}}}},
        "/unload": {"post": _operation("Unload the model (frees its memory)", None, _ok(ANY_OBJECT), CALL_ERRORS)},
        "/stats": {"get": _operation("Engine and front-end counters", None, _ok(ANY_OBJECT), CALL_ERRORS)},
        "/admin/engines": {"get": _operation("Engines behind this front-end", None, _ok(ANY_OBJECT), CALL_ERRORS)},
        **{f"/admin/engines/{{engine_id}}/{verb}": {"post": {**_operation(
            f"{verb.capitalize()} an engine", None, _ok(ANY_OBJECT), (401, 404, 503, 504)),
            "parameters": ENGINE_ID}} for verb in ("drain", "undrain")},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": STRING}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3 document", "content": _json(ANY_OBJECT)}}}}, **AUDIO_PATHS}
    return {
        "openapi": "3.0.3",
        "info": {"title": "mlx-engined", "version": "1",
                 "description": "OpenAI- and Anthropic-compatible API for local MLX models. Every /v1 route also "
                                "answers without the /v1 prefix."},
        "paths": paths,
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
    }


class OpenAPIResource:
    """Serves the document; it is static, so it is built once."""

    def __init__(self) -> None:
        self.document = openapi_document()

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = self.document
