"""Anthropic Messages requests -> the engine's ADD body (the chat route's shapes).

The engine speaks one chat format (OpenAI chat messages, function tools, tool_choice
strings), so an Anthropic request is rewritten into it and then checked by the same
helpers the chat route uses: one set of rules for messages, tools and tool_choice,
whichever API a client speaks. Anthropic-only rules (roles, block types, `max_tokens`
required, `thinking`) are checked here first, so errors name Anthropic's fields.
"""

from __future__ import annotations

import json
from typing import Any

from http_frontend.anthropic.search_results import search_result_text
from http_frontend.anthropic.tools import deferred_tools, parse_anthropic_tool_choice, parse_anthropic_tools
from http_frontend.errors import bad_request
from http_frontend.parsing.body import get_field
from http_frontend.parsing.documents import document_text
from http_frontend.parsing.generation_fields import parse_response_format
from http_frontend.parsing.media import SOURCE_PARAM, MediaCollector
from http_frontend.parsing.messages import check_message_count, parse_messages
from http_frontend.parsing.sampling import MAX_STOP_LENGTH, MAX_STOP_STRINGS, check_max_tokens, check_stop_lengths
from http_frontend.settings import FrontendSettings
from protocol.messages import STRICT_CLOSED

# Block types a client may send back unchanged but that carry nothing a local model can use: encrypted
# thinking, and Anthropic-hosted tools' calls and results (web search, code execution, …) replayed by
# Claude Code; dropped rather than refused, so a conversation that used them goes on.
IGNORED_BLOCKS = {"redacted_thinking", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                  "code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                  "container_upload"}
# Request fields of Anthropic's hosted features: refused rather than silently dropped.
UNSUPPORTED_FIELDS = {
    "mcp_servers": "MCP connectors are not supported by this server",
    "container": "Code-execution containers are not supported by this server",
}


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """A message's content as typed blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{param}: expected a string or an array of content blocks", param=param,
                          code="invalid_type")
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{param}.{index}: expected a content block object with a 'type'",
                              param=f"{param}.{index}", code="invalid_type")
    return content


def _text(block: dict[str, Any], param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{param}.text: expected a string", param=f"{param}.text", code="invalid_type")
    return block["text"]


def _image_part(block: dict[str, Any], param: str) -> dict[str, Any]:
    """An image block as an OpenAI image_url part (base64 sources become data: URLs)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise bad_request(f"{param}.source: expected a base64 source (media_type, data) or a url source",
                          param=f"{param}.source", code="invalid_value")
    return {"type": "image_url", "image_url": {"url": url}, SOURCE_PARAM: param}


def _tool_result(block: dict[str, Any], param: str, deferred: dict[str, dict[str, Any]]
                 ) -> tuple[str, list[dict[str, Any]]]:
    """A tool_result's content as the text of a `tool` message, and the images it carried.

    Text, documents and search results become the tool message's text. Images go to a user turn right after
    the tool results (`_user_turn`): chat templates render images in user turns, and a model
    that takes no images refuses them there with the same 400 as any user image.
    """
    content = block.get("content")
    if content is None:
        return "", []
    texts, images = [], []
    for index, part in enumerate(_blocks(content, f"{param}.content")):
        where = f"{param}.content.{index}"
        if part["type"] == "text":
            texts.append(_text(part, where))
        elif part["type"] == "document":
            texts.append(document_text(part, where))
        elif part["type"] == "search_result":
            texts.append(search_result_text(part, where))
        elif part["type"] == "image":
            images.append(_image_part(part, where))
            texts.append(f"[image {len(images)}: shown in the next user turn]")
        elif part["type"] == "tool_reference":  # tool search loaded a deferred tool: its definition, here
            if not isinstance(part.get("tool_name"), str) or not part["tool_name"]:
                raise bad_request(f"{where}.tool_name: expected a string", param=f"{where}.tool_name",
                                  code="invalid_type")
            texts.append(_loaded_tool(part["tool_name"], deferred))
        elif part["type"] not in IGNORED_BLOCKS:
            raise bad_request(f"{where}: '{part['type']}' blocks in a tool_result are not supported",
                              param=where, code="unsupported_content")
    return "\n".join(texts), images


def _loaded_tool(name: str, deferred: dict[str, dict[str, Any]]) -> str:
    """What a `tool_reference` reads as: a deferred tool's definition (the prompt lists only the others:
    `rendered_tools`), where the tool search put it, as Anthropic expands it; any other tool is listed."""
    tool = deferred.get(name)
    if tool is None:
        return f"Tool {name} loaded: it can be called now."
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    schema = json.dumps(tool.get("input_schema") or {}, ensure_ascii=False)
    return f"Tool {name} loaded: it can be called now. {description} Its input follows this JSON schema: {schema}"


def _user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text-only content as one string; with images, OpenAI content parts in the original order."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _user_turn(blocks: list[dict[str, Any]], param: str, deferred: dict[str, dict[str, Any]],
               calls: set[str]) -> list[dict[str, Any]]:
    """One Anthropic user turn -> `tool` messages for its tool results and `user` messages for the rest.

    A tool_result must answer a tool_use of the assistant turn before it (`calls`), in Anthropic's words.
    """
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    attachments: list[dict[str, Any]] = []  # tool results' images: after the run of tool results

    def flush(with_attachments: bool = True) -> None:
        content = (attachments if with_attachments else []) + parts
        if content:
            messages.append({"role": "user", "content": _user_content(list(content))})
        parts.clear()
        if with_attachments:
            attachments.clear()

    for index, block in enumerate(blocks):
        where, kind = f"{param}.{index}", block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        elif kind == "image":
            parts.append(_image_part(block, where))
        elif kind == "document":
            parts.append({"type": "text", "text": document_text(block, where)})
        elif kind == "search_result":
            parts.append({"type": "text", "text": search_result_text(block, where)})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise bad_request(f"{where}.tool_use_id: expected a string", param=f"{where}.tool_use_id",
                                  code="invalid_type")
            if block["tool_use_id"] not in calls:
                raise bad_request(f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: "
                                  f"{block['tool_use_id']}. Each `tool_result` block must have a corresponding "
                                  "`tool_use` block in the previous message.", param=where)
            flush(with_attachments=False)
            text, images = _tool_result(block, where, deferred)
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            if images:
                attachments.append({"type": "text", "text": f"Images from the result of tool call "
                                                            f"{block['tool_use_id']}:"})
                attachments.extend(images)
        elif kind not in IGNORED_BLOCKS:
            raise bad_request(f"{where}: content blocks of type '{kind}' are not supported in a user turn",
                              param=where, code="unsupported_content")
    flush()
    return messages


def _assistant_turn(blocks: list[dict[str, Any]], param: str) -> dict[str, Any]:
    """One Anthropic assistant turn -> one assistant message with text, reasoning and tool_calls."""
    texts, thinking, calls = [], [], []
    for index, block in enumerate(blocks):
        where, kind = f"{param}.{index}", block["type"]
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "tool_use":
            name, tool_input = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(tool_input, dict):
                raise bad_request(f"{where}: a tool_use block needs a string 'name' and an object 'input'",
                                  param=where, code="invalid_type")
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(tool_input)}})
        elif kind not in IGNORED_BLOCKS:
            raise bad_request(f"{where}: content blocks of type '{kind}' are not supported in an assistant turn",
                              param=where, code="unsupported_content")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def parse_system(body: dict[str, Any], param: str = "system") -> str | None:
    """`system`: a string or an array of text blocks (joined by newlines).

    A system turn inside `messages` (`param` names it) may also carry Claude Code's tool changes
    (`tool_addition` / `tool_removal`, beta `mid-conversation-tool-changes`): they become notes the
    model reads, since the tools of the prompt are rendered once, from `tools`.
    """
    system = get_field(body, "system", (str, list))
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for index, block in enumerate(_blocks(system, param)):
        where = f"{param}.{index}"
        if block["type"] in ("tool_addition", "tool_removal") and param != "system":
            texts.append(_tool_change(block, where))
        elif block["type"] != "text":
            raise bad_request(f"{where}: only text blocks are allowed in a system turn", param=where,
                              code="invalid_value")
        else:
            texts.append(_text(block, where))
    return "\n".join(texts) or None


def _tool_change(block: dict[str, Any], where: str) -> str:
    """A tool added or removed mid-conversation, as a note: its name, and an added tool's description and schema."""
    tool = block.get("tool") if isinstance(block.get("tool"), dict) else {}
    definition = tool.get("definition") if isinstance(tool.get("definition"), dict) else tool
    name = definition.get("name") or tool.get("name") or tool.get("tool_name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.tool: expected a tool with a 'name'", param=f"{where}.tool", code="invalid_value")
    if block["type"] == "tool_removal":
        return f"The tool {name} is no longer available: do not call it."
    description = definition.get("description") if isinstance(definition.get("description"), str) else ""
    schema = json.dumps(definition.get("input_schema") or {}, ensure_ascii=False)
    return f"A new tool is available: {name}. {description} Its input follows this JSON schema: {schema}".strip()


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`system` + `messages` as OpenAI chat messages (before the chat route's own checks)."""
    messages = get_field(body, "messages", (list,), required=True)
    if not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    converted: list[dict[str, Any]] = []
    calls: set[str] = set()  # the tool_use ids of the last assistant turn
    dropped: list[str] = []  # user turns of blocks that reach no model, for the error that names them
    deferred = deferred_tools(body)
    system = parse_system(body)
    if system is not None:
        converted.append({"role": "system", "content": system})
    for index, message in enumerate(messages):
        param = f"messages.{index}"
        if not isinstance(message, dict):
            raise bad_request(f"{param}: expected an object", param=param, code="invalid_type")
        role = message.get("role")
        if role == "system":
            # Claude Code (beta `mid-conversation-system-…`) puts system turns inside `messages`: the client
            # users run wins over the documented shape. They reach the template as system turns (the engine
            # folds them into the next user turn where a template takes no system turn there).
            text = parse_system({"system": message.get("content")}, f"{param}.content")
            if text:
                converted.append({"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise bad_request(f"{param}.role: expected 'user', 'assistant' or 'system', got {role!r}",
                              param=f"{param}.role")
        blocks = _blocks(message.get("content"), f"{param}.content")
        if role == "user":
            turn = _user_turn(blocks, f"{param}.content", deferred, calls)
            if not turn and blocks:
                dropped.append(f"{param} ({', '.join(sorted({block['type'] for block in blocks}))})")
            converted.extend(turn)
        else:
            answered = calls if index and messages[index - 1].get("role") == "assistant" else set()  # one turn
            converted.append(_assistant_turn(blocks, f"{param}.content"))
            calls = answered | {call["id"] for call in converted[-1].get("tool_calls", ())}
    if not any(turn["role"] == "user" for turn in converted):
        because = f": {'; '.join(dropped)} only hold blocks this server does not pass to the model" if dropped else ""
        raise bad_request(f"messages: at least one 'user' message is required{because}",
                          param="messages")
    if messages[-1].get("role") == "assistant":
        # A final assistant turn asks the model to continue it; the engine always opens a new turn.
        raise bad_request("Prefilling the assistant's response (a final 'assistant' message) is not supported; "
                          "end with a 'user' message", param=f"messages.{len(messages) - 1}",
                          code="unsupported_parameter")
    return converted


def parse_thinking(body: dict[str, Any], max_tokens: int | None) -> tuple[dict[str, Any] | None, int | None]:
    """`thinking` -> (chat_template_kwargs, thinking budget).

    Anthropic's 1,024-token minimum budget is not enforced: small local models
    are often run with much smaller budgets.
    """
    thinking = get_field(body, "thinking", (dict,))
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad_request("thinking.budget_tokens: a positive integer is required", param="thinking.budget_tokens",
                              code="invalid_value")
        if max_tokens is not None and budget >= max_tokens:
            raise bad_request("thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
        return {"enable_thinking": True}, budget
    if kind == "adaptive":
        return {"enable_thinking": True}, None
    if kind == "disabled":
        return {"enable_thinking": False}, None
    raise bad_request(f"thinking.type: expected 'enabled', 'adaptive' or 'disabled', got {kind!r}",
                      param="thinking.type")


def parse_output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """Structured outputs (`output_config.format` or the older `output_format`) as a json_schema response_format."""
    config = get_field(body, "output_config", (dict,))
    spec = (config or {}).get("format") or get_field(body, "output_format", (dict,))
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise bad_request("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
                          param="output_config.format")
    # Anthropic's strictness, not OpenAI's (`STRICT_CLOSED`): objects are closed, as its SDK's `transform_schema`
    # closes them, and properties left out of `required` stay optional.
    parsed = parse_response_format({"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": spec["schema"]}}})
    return {**parsed, "json_schema": {**parsed["json_schema"], "strict": STRICT_CLOSED}}


def parse_stop_sequences(body: dict[str, Any], max_count: int = MAX_STOP_STRINGS,
                         max_length: int = MAX_STOP_LENGTH) -> list[str] | None:
    stops = get_field(body, "stop_sequences", (list,))
    if stops is None:
        return None
    if len(stops) > max_count or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop_sequences: expected at most {max_count} strings", param="stop_sequences")
    check_stop_lengths(stops, "stop_sequences", max_length)
    return [s for s in stops if s] or None


def parse_params(body: dict[str, Any], limit: int | None,
                 stop_limits: tuple[int, int] = (MAX_STOP_STRINGS, MAX_STOP_LENGTH)) -> dict[str, Any]:
    """`max_tokens` (required, as Anthropic requires it), sampling fields and stop sequences."""
    params = {
        "max_tokens": get_field(body, "max_tokens", (int,), required=True, minimum=1),
        "temperature": get_field(body, "temperature", (float,), minimum=0, maximum=1),
        "top_p": get_field(body, "top_p", (float,), minimum=0, maximum=1),
        "top_k": get_field(body, "top_k", (int,), minimum=0),
        "stop": parse_stop_sequences(body, *stop_limits),
    }
    check_max_tokens(body, params, limit)
    return {key: value for key, value in params.items() if value is not None}


def engine_request(body: dict[str, Any], settings: FrontendSettings, *, generation: bool = True,
                   media: MediaCollector | None = None) -> dict[str, Any]:
    """The ADD body (without rid/epoch) for an Anthropic request; `generation=False` for count_tokens.

    Image blocks are registered with `media` (the caller resolves it into the ADD's `media`).
    """
    for name, message in UNSUPPORTED_FIELDS.items():
        if body.get(name):
            raise bad_request(message, param=name, code="unsupported_parameter")
    check_message_count(body, settings.max_messages)
    params = (parse_params(body, settings.max_tokens_limit, (settings.max_stop_strings, settings.max_stop_length))
              if generation else {})
    template_kwargs, budget = parse_thinking(body, params.get("max_tokens"))
    if budget is not None:
        params["thinking_budget"] = budget
    tools = parse_anthropic_tools(body)
    tool_choice, parallel = parse_anthropic_tool_choice(body, tools)
    request = {"model": get_field(body, "model", (str,)),
               "messages": parse_messages({"messages": chat_messages(body)}, media),
               "chat_template_kwargs": template_kwargs, "tools": tools, "tool_choice": tool_choice,
               "parallel_tool_calls": parallel, "response_format": parse_output_format(body)}
    if generation:
        request["params"] = params
    return {key: value for key, value in request.items() if value is not None}
