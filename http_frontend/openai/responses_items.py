"""Responses API request fields -> the engine's chat-shaped ADD (messages, tools, formats).

The engine speaks OpenAI chat: input items become chat messages, function tools
and `tool_choice` take their chat shape, `text.format` becomes `response_format`,
and `reasoning.effort` steers the template's thinking switch. Every refusal is a
400 naming the offending field as OpenAI spells it (`input[2].content[0].type`).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from http_frontend.errors import APIError, bad_request
from http_frontend.openai.responses_tools import ToolCatalog, build_catalog
from http_frontend.parsing.body import one_of
from http_frontend.parsing.generation_fields import REASONING_EFFORTS
from http_frontend.parsing.json_limits import check_json_text
from http_frontend.parsing.media import MediaCollector

log = logging.getLogger(__name__)

MESSAGE_ROLES = {"user", "assistant", "system", "developer"}
TEXT_PARTS = {"input_text", "output_text"}
MEDIA_PARTS = {"input_image", "input_audio"}  # Responses' names for what MediaCollector takes
TOOL_CHOICE_MODES = {"none", "auto", "required"}
# Items agents replay that carry nothing the model could use here: hosted tools' calls (their
# results live at the provider), encrypted compaction summaries, searches of tool catalogues,
# references to items stored at OpenAI, Codex's local snapshots. Skipped, with a debug line.
SKIPPED_ITEMS = frozenset({
    "web_search_call", "compaction", "compaction_summary", "tool_search_call", "tool_search_output",
    "image_generation_call", "code_interpreter_call", "file_search_call", "computer_call", "computer_call_output",
    "mcp_list_tools", "mcp_call", "mcp_approval_request", "mcp_approval_response", "item_reference",
    "ghost_snapshot",
})
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
    """A function_call_output's `output`: a string or input_text parts (an image part is named, not shown)."""
    if isinstance(output, list):
        output = [{"type": "input_text", "text": "[image]"}
                  if isinstance(p, dict) and one_of(p.get("type"), MEDIA_PARTS)
                  else p for p in output]  # a non-string type is left for _content to refuse
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


def tools_of(body: dict[str, Any]) -> ToolCatalog:
    """`tools` and every `additional_tools` input item (Codex's "Responses lite") as one catalogue."""
    lists: list[tuple[Any, str]] = [(body.get("tools"), "tools")]
    items = body.get("input")
    if isinstance(items, list):
        lists += [(item.get("tools"), f"input[{i}].tools") for i, item in enumerate(items)
                  if isinstance(item, dict) and item.get("type") == "additional_tools"]
    return build_catalog(lists)


def parse_input(value: Any, max_items: int, media: MediaCollector | None = None,
                catalog: ToolCatalog | None = None) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as chat messages; images and audio go to `media`.

    Replayed calls are named as the model was offered them (`ToolCatalog.offered_name`).
    """
    catalog = catalog or ToolCatalog()
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
            namespace = _string(item.get("namespace"), f"{where}.namespace", required=False)
            arguments = _string(item.get("arguments"), f"{where}.arguments")
            check_json_text(arguments, f"{where}.arguments")  # JSON the engine parses for the chat template
            conversation.add_call(_string(item.get("call_id"), f"{where}.call_id"),
                                  catalog.offered_name(_string(item.get("name"), f"{where}.name"), namespace),
                                  arguments)
        elif kind == "custom_tool_call":
            namespace = _string(item.get("namespace"), f"{where}.namespace", required=False)
            conversation.add_call(_string(item.get("call_id"), f"{where}.call_id"),
                                  catalog.offered_name(_string(item.get("name"), f"{where}.name"), namespace),
                                  json.dumps({"input": _string(item.get("input"), f"{where}.input")},
                                             ensure_ascii=False))
        elif kind == "local_shell_call":
            call_id = item.get("call_id") or item.get("id")
            conversation.add_call(_string(call_id, f"{where}.call_id"), "local_shell",
                                  json.dumps(item.get("action") or {}, ensure_ascii=False))
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            conversation.add_result(_string(item.get("call_id"), f"{where}.call_id"),
                                    _output_text(item.get("output"), f"{where}.output"))
        elif kind == "reasoning":
            conversation.pending_reasoning = _reasoning_text(item)
        elif kind == "additional_tools":
            continue  # its tools joined the request's (`tools_of`)
        elif one_of(kind, SKIPPED_ITEMS):
            log.debug("%s: a %s item carries nothing for the model here: skipped", where, kind)
        else:
            raise bad_request(f"Input items of type {kind!r} are not supported", param=f"{where}.type",
                              code="unsupported_parameter")
    return conversation.messages


def name_tool_results(messages: list[dict[str, Any]], calls_elsewhere: bool = False) -> list[dict[str, Any]]:
    """Gives each tool result the name of the call it answers (some templates print it).

    A result that answers no earlier call (in this input or the `previous_response_id` chain) is
    refused as OpenAI refuses it: a model shown an output of a call it never made is misled. Unless
    `calls_elsewhere`: the input skipped items that may hold its call (an `item_reference` to an item
    stored at OpenAI, a compaction), which OpenAI resolves and this server cannot.
    """
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
        if message["role"] != "tool" or (calls_elsewhere and message["tool_call_id"] not in names):
            continue
        if message["tool_call_id"] not in names:
            raise APIError(400, f"No tool call found for function call output with call_id "
                                f"{message['tool_call_id']}.", param="input")  # OpenAI's words; its code is null
        message.setdefault("name", names[message["tool_call_id"]])
    return messages


def skips_items(body: dict[str, Any]) -> bool:
    """Whether the request's `input` holds items skipped here (`SKIPPED_ITEMS`), which may hold calls."""
    items = body.get("input")
    return isinstance(items, list) and any(isinstance(item, dict) and item.get("type") in SKIPPED_ITEMS
                                           for item in items)


TRUNCATION_MODES = {"auto": "truncate", "disabled": "error"}  # Responses `truncation` -> the ADD's context_overflow


def parse_truncation(value: Any) -> str | None:
    """`truncation`: "auto" drops the oldest input items to fit the window, "disabled" refuses (400), as
    OpenAI; absent (null), the model's own `context_overflow` setting decides."""
    if value is None or one_of(value, TRUNCATION_MODES):
        return value
    raise bad_request(f"Invalid value for 'truncation': {value!r}; expected 'auto' or 'disabled'",
                      param="truncation")


def _allowed_tools(value: dict[str, Any], catalog: ToolCatalog) -> str | dict[str, Any]:
    """`{"type": "allowed_tools", "mode", "tools": [...]}` in the engine's shape (names the model knows).

    Function and custom tools must be in `tools`; hosted ones are not offered, so they allow nothing.
    """
    mode, listed = value.get("mode", "auto"), value.get("tools")
    if mode not in ("auto", "required") or not isinstance(listed, list):
        raise bad_request("Invalid 'tool_choice': allowed_tools needs 'mode' ('auto' or 'required') and a "
                          "'tools' list", param="tool_choice")
    offered = {t["function"]["name"] for t in catalog.tools}
    names, hosted = [], False
    for index, tool in enumerate(listed):
        if not isinstance(tool, dict) or tool.get("type") not in ("function", "custom"):
            hosted = True  # a hosted tool: not offered to the model
            continue
        name, namespace = tool.get("name"), tool.get("namespace")
        name = catalog.offered_name(name, namespace if isinstance(namespace, str) else None) \
            if isinstance(name, str) else None
        if name not in offered:
            raise bad_request(f"'tool_choice.tools[{index}]' names a tool that is not in 'tools'",
                              param=f"tool_choice.tools[{index}]")
        names.append(name)
    if not names:
        if hosted:
            return "auto"  # only hosted tools allowed: as a hosted tool's own choice, nothing is forced
        if mode == "required":
            raise bad_request("'tool_choice' is allowed_tools 'required' but allows no tool", param="tool_choice")
        return "none"
    return {"type": "allowed_tools", "mode": mode, "tools": names}


def parse_tool_choice(value: Any, catalog: ToolCatalog) -> str | dict[str, Any] | None:
    """A Responses `tool_choice` in chat's shape: a mode, or the one function (or custom tool) to call.

    Objects name a mode too (`{"type": "required"}` from LiteLLM; `any` is Anthropic's
    `required`); `allowed_tools` names the tools a call may use (`_allowed_tools`); a hosted
    tool's type (`{"type": "web_search_preview"}`) is `auto`: that tool is not offered.
    """
    if value is None:
        return None
    tools = catalog.tools
    kind = value.get("type") if isinstance(value, dict) else None
    if one_of(kind, (*TOOL_CHOICE_MODES, "any")):
        value = "required" if kind == "any" else kind
    elif kind == "allowed_tools":
        return _allowed_tools(value, catalog)
    elif isinstance(kind, str) and kind not in ("function", "custom"):
        value = "auto"  # a hosted tool's type: that tool is not offered
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise bad_request(f"Invalid value for 'tool_choice': {value!r}; expected one of "
                              f"{sorted(TOOL_CHOICE_MODES)} or a function", param="tool_choice")
        choice: str | dict[str, Any] = value
    elif isinstance(value, dict):
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'tool_choice' of type {value.get('type')!r} needs a 'name'", param="tool_choice")
        offered = catalog.offered_name(name, value.get("namespace") if isinstance(value.get("namespace"), str)
                                       else None)
        if offered not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"'tool_choice' names the tool {name!r}, which is not in 'tools'", param="tool_choice")
        choice = {"type": "function", "function": {"name": offered}}
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
