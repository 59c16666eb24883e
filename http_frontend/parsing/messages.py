"""OpenAI chat `messages` -> the engine's chat messages, checked once for every API.

The engine speaks one chat format. Chat Completions and /tokenize send their
messages through here as they are; the Anthropic route first rewrites its messages
into chat messages and then passes them through the same rules, so a message is
refused for the same reason whichever API a client speaks.
"""

from __future__ import annotations

from typing import Any

from http_frontend.errors import bad_request
from http_frontend.parsing.body import get_field
from http_frontend.parsing.json_limits import check_json_text
from http_frontend.parsing.media import AUDIO_PART_TYPES, IMAGE_PART_TYPES, MediaCollector

ROLES = {"system", "developer", "user", "assistant", "tool"}
MEDIA_PART_TYPES = IMAGE_PART_TYPES + AUDIO_PART_TYPES


def _message_text(message: dict[str, Any], index: int, media: MediaCollector | None = None) -> str | None:
    """Flattens OpenAI content (string or typed parts) into the text a chat template takes.

    Image and audio parts become placeholders in the text, their bytes entries of `media`
    (a `MediaCollector`); without a collector (routes that take no media) they are refused.
    """
    content = message.get("content")
    param = f"messages.[{index}].content"
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"Invalid type for '{param}': expected a string or an array of content parts",
                          param=param, code="invalid_type")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"Invalid content part in '{param}'", param=param, code="invalid_type")
        if part["type"] in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise bad_request(f"A text part in '{param}' needs a string 'text'", param=param,
                                  code="invalid_type")
            texts.append(part["text"])
        elif media is not None and part["type"] in MEDIA_PART_TYPES:
            texts.append(media.add_part(part, param, message.get("role", "")))
        else:
            raise bad_request(f"Content parts of type '{part['type']}' are not supported here",
                              param=param, code="unsupported_content")
    return "".join(texts)


def parse_messages(body: dict[str, Any], media: MediaCollector | None = None) -> list[dict[str, Any]]:
    """The body's `messages` as the engine takes them (`developer` becomes `system`); a bad one is a 400."""
    messages = get_field(body, "messages", (list,), required=True)
    if not messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"Invalid type for 'messages.[{index}]': expected an object",
                              param=f"messages.[{index}]", code="invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"Invalid value for 'messages.[{index}].role': {role!r}; expected one of "
                              f"{sorted(ROLES)}", param=f"messages.[{index}].role")
        text = _message_text(message, index, media)
        entry = {"role": "system" if role == "developer" else role, "content": text or ""}
        entry.update(_tool_fields(message, index, role))
        parsed.append(entry)
    return parsed


def _tool_fields(message: dict[str, Any], index: int, role: str) -> dict[str, Any]:
    """An assistant turn's `tool_calls` (and reasoning) and a tool result's `tool_call_id`, checked."""
    fields: dict[str, Any] = {}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            param = f"messages.[{index}].tool_calls"
            if not isinstance(calls, list):
                raise bad_request(f"Invalid type for '{param}': expected an array", param=param, code="invalid_type")
            checked = []
            for number, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise bad_request(f"Invalid '{param}': each call needs a 'function' with a string 'name'",
                                      param=param, code="invalid_type")
                arguments = function.get("arguments", "{}")
                if not isinstance(arguments, (str, dict)):
                    raise bad_request(f"Invalid '{param}': 'arguments' must be a JSON string", param=param,
                                      code="invalid_type")
                if isinstance(arguments, str):  # JSON the engine parses for the chat template
                    check_json_text(arguments, f"{param}.[{number}].function.arguments")
                checked.append({"id": str(call.get("id") or ""), "type": "function",
                                "function": {"name": function["name"], "arguments": arguments}})
            if checked:
                fields["tool_calls"] = checked
        for key in ("reasoning_content", "reasoning"):
            if isinstance(message.get(key), str) and message[key]:
                fields["reasoning_content"] = message[key]
                break
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"Invalid type for 'messages.[{index}].tool_call_id': expected a string",
                              param=f"messages.[{index}].tool_call_id", code="invalid_type")
        if call_id:
            fields["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        fields["name"] = message["name"]
    return fields


def check_message_count(body: dict[str, Any], limit: int) -> None:
    """Before parsing: a huge message list is refused without walking it."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limit:
        raise bad_request(f"Invalid 'messages': array too long. Expected an array with maximum length {limit}, "
                          f"but got an array with length {len(messages)} instead.", param="messages",
                          code="array_above_max_length")
