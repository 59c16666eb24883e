"""Responses API request fields -> the engine's chat-shaped ADD (messages, tools, formats).

The engine speaks OpenAI chat: input items become chat messages, function tools
and `tool_choice` take their chat shape, `text.format` becomes `response_format`,
and `reasoning.effort` steers the template's thinking switch. Every refusal is a
400 naming the offending field as OpenAI spells it (`input[2].content[0].type`).
"""

from __future__ import annotations

import uuid
from typing import Any

from http_frontend.errors import bad_request
from http_frontend.parsing.generation_fields import REASONING_EFFORTS, check_tool_count, function_tool, unique_tools
from http_frontend.parsing.media import MediaCollector

MESSAGE_ROLES = {"user", "assistant", "system", "developer"}
TEXT_PARTS = {"input_text", "output_text"}
MEDIA_PARTS = {"input_image", "input_audio"}  # Responses' names for what MediaCollector takes
TOOL_CHOICE_MODES = {"none", "auto", "required"}
# Efforts that ask for no thinking: templates that can switch it off get enable_thinking=false.
NO_THINKING_EFFORTS = {"none", "minimal"}


def _invalid_type(param: str, expected: str) -> Exception:
    return bad_request(f"Invalid type for '{param}': expected {expected}", param=param, code="invalid_type")


def _string(value: Any, param: str, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        if value is None:
            raise bad_request(f"Missing required parameter: '{param}'", param=param,
                              code="missing_required_parameter")
        raise _invalid_type(param, "a string")
    return value


def _content(content: Any, param: str, role: str = "", media: MediaCollector | None = None) -> str:
    """A message's content as the text a chat template takes.

    Image and audio parts (`input_image`, `input_audio`) go to the request's media
    collector, as the chat route's do (`MediaCollector`): their place in the
    text is a placeholder the engine matches to the bytes. Without a collector
    (function call outputs) only text is accepted.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid_type(param, "a string or an array of content parts")
    texts: list[str] = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise _invalid_type(where, "an object")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise _invalid_type(f"{where}.type", "a string")
        if kind in TEXT_PARTS:
            texts.append(_string(part.get("text"), f"{where}.text"))
        elif kind == "refusal":
            texts.append(_string(part.get("refusal"), f"{where}.refusal"))
        elif media is not None and kind in MEDIA_PARTS:
            if kind == "input_image" and part.get("image_url") is None and part.get("file_id") is not None:
                raise bad_request(f"'{where}': file ids are not supported; send 'image_url' (a URL or a data: "
                                  "URL)", param=f"{where}.file_id", code="unsupported_parameter")
            texts.append(media.add_part(part, where, role))
        else:
            raise bad_request(f"Content parts of type {kind!r} are not supported here", param=f"{where}.type",
                              code="unsupported_content")
    return "".join(texts)


def _output_text(output: Any, param: str) -> str:
    """A function_call_output's `output`: a string or input_text parts."""
    return _content(output, param)


def _reasoning_text(item: dict[str, Any]) -> str:
    """The text of a reasoning input item: its reasoning_text content, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
            if texts:
                return "\n".join(texts)
    return ""


class _Conversation:
    """Builds chat messages item by item; function calls join the assistant turn they belong to."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.pending_reasoning = ""

    def _assistant(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.pending_reasoning:
            message["reasoning_content"] = self.pending_reasoning
            self.pending_reasoning = ""
        return message

    def add_message(self, role: str, content: str) -> None:
        message = {"role": "system" if role == "developer" else role, "content": content}
        self.messages.append(self._assistant(message) if role == "assistant" else message)

    def add_call(self, call_id: str, name: str, arguments: str) -> None:
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and not self.pending_reasoning:
            last.setdefault("tool_calls", []).append(call)
        else:
            self.messages.append(self._assistant({"role": "assistant", "content": "", "tool_calls": [call]}))

    def add_result(self, call_id: str, output: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})


def parse_input(value: Any, max_items: int, media: MediaCollector | None = None) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as chat messages; images and audio go to `media`."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _invalid_type("input", "a string or an array of input items")
    if len(value) > max_items:
        raise bad_request(f"Invalid 'input': array too long. Expected an array with maximum length {max_items}, "
                          f"but got an array with length {len(value)} instead.", param="input",
                          code="array_above_max_length")
    conversation = _Conversation()
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _invalid_type(where, "an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in MESSAGE_ROLES:
                raise bad_request(f"Invalid value for '{where}.role': {role!r}; expected one of "
                                  f"{sorted(MESSAGE_ROLES)}", param=f"{where}.role")
            conversation.add_message(role, _content(item.get("content"), f"{where}.content", role, media))
        elif kind == "function_call":
            conversation.add_call(_string(item.get("call_id"), f"{where}.call_id"),
                                  _string(item.get("name"), f"{where}.name"),
                                  _string(item.get("arguments"), f"{where}.arguments"))
        elif kind == "function_call_output":
            conversation.add_result(_string(item.get("call_id"), f"{where}.call_id"),
                                    _output_text(item.get("output"), f"{where}.output"))
        elif kind == "reasoning":
            conversation.pending_reasoning = _reasoning_text(item)
        else:
            raise bad_request(f"Input items of type {kind!r} are not supported", param=f"{where}.type",
                              code="unsupported_parameter")
    return conversation.messages


def name_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gives each tool result the name of the call it answers (some templates print it)."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and "name" not in message and message["tool_call_id"] in names:
            message["name"] = names[message["tool_call_id"]]
    return messages


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses function tools -> chat function tools; other tool types are refused.

    Names follow the chat route's rules (generation_fields), so both routes accept the same tools.
    """
    if value is None:
        return None
    if not isinstance(value, list):
        raise _invalid_type("tools", "an array of tools")
    check_tool_count(value)
    tools = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _invalid_type(where, "an object")
        if tool.get("type") != "function":
            raise bad_request(f"Invalid '{where}': tools of type {tool.get('type')!r} are not supported; only "
                              f"'function' tools are", param=where, code="unsupported_parameter")
        tools.append(function_tool(tool, where))
    return unique_tools(tools)


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    """"none" | "auto" | "required" | {"type": "function", "name"} in chat's shape."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise bad_request(f"Invalid value for 'tool_choice': {value!r}; expected one of "
                              f"{sorted(TOOL_CHOICE_MODES)} or a function", param="tool_choice")
        choice: str | dict[str, Any] = value
    elif isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("'tool_choice' of type 'function' needs a 'name'", param="tool_choice")
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                              param="tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    elif isinstance(value, dict):
        raise bad_request(f"tool_choice of type {value.get('type')!r} is not supported", param="tool_choice",
                          code="unsupported_parameter")
    else:
        raise _invalid_type("tool_choice", "a string or an object")
    if choice == "required" and not tools:
        raise bad_request("'tool_choice' is 'required' but no 'tools' were given", param="tool_choice")
    return choice


def parse_text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` -> the ADD's `response_format` (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _invalid_type("text", "an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _invalid_type("text.format", "an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        name = _string(fmt.get("name"), "text.format.name")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("'text.format.schema' must be a JSON Schema object", param="text.format.schema",
                              code="invalid_type" if schema is not None else "missing_required_parameter")
        json_schema: dict[str, Any] = {"name": name, "schema": schema}
        if fmt.get("strict") is not None:
            if not isinstance(fmt["strict"], bool):
                raise _invalid_type("text.format.strict", "a boolean")
            json_schema["strict"] = fmt["strict"]
        if isinstance(fmt.get("description"), str):
            json_schema["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": json_schema}
    raise bad_request(f"Invalid value for 'text.format.type': {kind!r}; expected 'text', 'json_object' or "
                      f"'json_schema'", param="text.format.type")


def parse_reasoning(value: Any) -> str | None:
    """`reasoning.effort`, checked ("none"/"minimal" switch thinking off, see NO_THINKING_EFFORTS)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid_type("reasoning", "an object")
    effort = value.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in REASONING_EFFORTS):
        raise bad_request(f"Invalid value for 'reasoning.effort': {effort!r}; expected one of "
                          f"{sorted(REASONING_EFFORTS)}", param="reasoning.effort")
    return effort


def input_item_list(value: Any) -> list[dict[str, Any]]:
    """A request's `input` as OpenAI lists it under GET /v1/responses/{id}/input_items.

    A string is one user message; message items get an id, a status and typed content
    parts; other items (function calls and their outputs, reasoning) are kept as sent.
    """
    if value is None:
        return []
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    listed = []
    for item in items:
        if not isinstance(item, dict):
            continue
        item = dict(item)
        if item.get("type", "message") == "message":
            item["type"] = "message"
            part_type = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": part_type, "text": item["content"]}]
            item.setdefault("status", "completed")
            item.setdefault("id", f"msg_{uuid.uuid4().hex}")
        else:
            item.setdefault("id", f"{str(item['type']).split('_')[0]}_{uuid.uuid4().hex}")
        listed.append(item)
    return listed
