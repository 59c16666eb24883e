"""Validation of the chat fields that steer what the model produces, not how it samples.

Tools, tool_choice, response_format and the reasoning switches are checked here
and forwarded in the ADD as plain values: the engine applies them (chat template,
constrained decoding, output parsing). Each error names the offending `param`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from http_frontend.errors import bad_request
from http_frontend.parsing.body import get_field

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Keyword arguments of the chat template call that are not template variables: refused in
# `chat_template_kwargs`, as the engine refuses them (`engine_daemon.request.template_kwargs.RESERVED`).
# `chat_template` is not among them: the engine decides (its --allow-request-chat-template flag).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "add_generation_prompt", "continue_final_message", "conversation", "documents", "max_length", "messages",
    "padding", "processor_kwargs", "return_assistant_tokens_mask", "return_dict", "return_tensors", "tokenize",
    "tokenizer_kwargs", "tools", "truncation",
})


# Tools a provider runs itself (or that need its server-side index): nothing here can run them, so
# they are left out of the prompt and named in `X-Ignored-Tools` rather than refused (agents send them).
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "web_search_20250305", "file_search", "code_interpreter", "computer_use_preview", "computer_use",
    "local_shell", "shell", "image_generation", "mcp", "tool_search", "apply_patch",
})


IGNORED_TOOLS_HEADER_CHARS = 1024


def ignored_tools_header(names: Iterable[str]) -> str:
    """`X-Ignored-Tools`: the names, once each, percent-encoded and capped.

    A header value must be visible ASCII, and a client may name a tool anything
    (non-ASCII, a comma, a newline): unescaped, such a name broke the response (500).
    """
    value = ",".join(quote(str(name), safe="-_.~:@") for name in dict.fromkeys(names))
    return value if len(value) <= IGNORED_TOOLS_HEADER_CHARS else value[:IGNORED_TOOLS_HEADER_CHARS - 3] + "..."


def is_hosted_tool(kind: Any) -> bool:
    """Whether a tool `type` is a hosted tool (dated variants such as `web_search_20250305` too)."""
    return isinstance(kind, str) and (kind in HOSTED_TOOLS or kind.startswith(("web_search", "computer_use")))


def hosted_tools(body: dict[str, Any]) -> list[str]:
    """The names (else types) of the hosted tools in a chat `tools` array, which `parse_tools` leaves out."""
    tools = body.get("tools")
    return [str(tool.get("name") or tool["type"]) for tool in tools if isinstance(tool, dict)
            and is_hosted_tool(tool.get("type"))] if isinstance(tools, list) else []


def check_tool_count(tools: list[Any]) -> None:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} tools", param="tools",
                          code="array_above_max_length")


def function_tool(spec: dict[str, Any], prefix: str) -> dict[str, Any]:
    """One function tool in chat's shape from its fields (`name`, `description`, `parameters`, `strict`).

    Shared by the chat route (fields under `function`) and Responses (fields at the top level);
    errors name `<prefix>.<field>`.
    """
    name = spec.get("name")
    if not isinstance(name, str):
        raise bad_request(f"Invalid type for '{prefix}.name': expected a string", param=f"{prefix}.name",
                          code="invalid_type")
    if not TOOL_NAME.match(name):
        raise bad_request(f"Invalid '{prefix}.name': {name!r} must match {TOOL_NAME.pattern}",
                          param=f"{prefix}.name", code="invalid_value")
    entry: dict[str, Any] = {"name": name, "parameters": {"type": "object", "properties": {}}}
    for key, kind, expected in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "a boolean")):
        if spec.get(key) is not None:
            if not isinstance(spec[key], kind):
                raise bad_request(f"Invalid type for '{prefix}.{key}': expected {expected}",
                                  param=f"{prefix}.{key}", code="invalid_type")
            entry[key] = spec[key]
    return {"type": "function", "function": entry}


def unique_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The tools (None when empty), refused when two share a name."""
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("Tool names in 'tools' must be unique", param="tools", code="invalid_value")
    return tools or None


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """OpenAI chat function tools, normalised to {"type": "function", "function": {name, description, parameters}}."""
    tools = get_field(body, "tools", (list,))
    if not tools:
        return None
    check_tool_count(tools)
    checked = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if isinstance(tool, dict) and is_hosted_tool(tool.get("type")):
            continue  # named by `hosted_tools`
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"Invalid '{param}': only tools of type 'function' are supported", param=param,
                              code="unsupported_parameter")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"Invalid '{param}.function': an object with a string 'name' is required",
                              param=f"{param}.function", code="invalid_type")
        checked.append(function_tool(function, f"{param}.function"))
    return unique_tools(checked)


def parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name"}} (a tool that exists), or
    allowed_tools (`allowed_tools_choice`)."""
    choice = get_field(body, "tool_choice", (str, dict))
    if choice is None:
        return None
    if isinstance(choice, dict) and choice.get("type") in ("none", "auto", "required", "any"):
        # The object form of a mode (LiteLLM sends {"type": "required"}); `any` is Anthropic's `required`.
        choice = "required" if choice["type"] == "any" else choice["type"]
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return allowed_tools_choice(choice.get("allowed_tools"), tools)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"Invalid value for 'tool_choice': {choice!r}; expected 'none', 'auto', 'required' "
                              "or a named function", param="tool_choice", code="invalid_value")
        if choice == "required" and not tools:
            raise bad_request("'tool_choice' is 'required' but no 'tools' were given", param="tool_choice",
                              code="invalid_value")
        return choice
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("Invalid 'tool_choice': expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          param="tool_choice", code="invalid_type")
    if name not in [tool["function"]["name"] for tool in tools or ()]:
        raise bad_request(f"Invalid 'tool_choice': function {name!r} is not in 'tools'", param="tool_choice",
                          code="invalid_value")
    return {"type": "function", "function": {"name": name}}


def allowed_tools_choice(spec: Any, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Chat's `{"type": "allowed_tools", "allowed_tools": {"mode", "tools": [...]}}` in the engine's shape.

    The engine keeps the whole tool list in the prompt for mode "required" and forces a call
    among the allowed ones (`engine_daemon.sampling.tool_choice`).
    """
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required") \
            or not isinstance(spec.get("tools"), list):
        raise bad_request("Invalid 'tool_choice.allowed_tools': expected {\"mode\": \"auto\" | \"required\", "
                          "\"tools\": [...]}", param="tool_choice.allowed_tools", code="invalid_value")
    listed = {tool["function"]["name"] for tool in tools or ()}
    names = []
    for index, tool in enumerate(spec["tools"]):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in listed:
            raise bad_request(f"Invalid 'tool_choice.allowed_tools.tools[{index}]': expected a function listed in "
                              "'tools'", param=f"tool_choice.allowed_tools.tools[{index}]", code="invalid_value")
        names.append(name)
    if spec["mode"] == "required" and not names:
        raise bad_request("'tool_choice.allowed_tools' is 'required' but allows no tool",
                          param="tool_choice.allowed_tools", code="invalid_value")
    return {"type": "allowed_tools", "mode": spec["mode"], "tools": names}


def parse_response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """text (None) | json_object | json_schema with a schema object; anything else is a 400, never ignored."""
    response_format = get_field(body, "response_format", (dict,))
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request("Invalid 'response_format.json_schema': expected an object with a 'schema' object",
                              param="response_format.json_schema", code="invalid_type")
        if not isinstance(spec.get("name", ""), str):
            raise bad_request("Invalid 'response_format.json_schema.name': expected a string",
                              param="response_format.json_schema.name", code="invalid_type")
        return {"type": "json_schema", "json_schema": {"name": spec.get("name", "response"),
                                                       "schema": spec.get("schema", {}),
                                                       "strict": bool(spec.get("strict", False))}}
    raise bad_request(f"Invalid value for 'response_format.type': {kind!r}; expected 'text', 'json_object' or "
                      "'json_schema'", param="response_format.type", code="invalid_value")


def check_template_kwargs(template_kwargs: Any) -> None:
    """`chat_template_kwargs` holds template variables only: an object with string keys, no reserved name."""
    if template_kwargs is None:
        return
    if not isinstance(template_kwargs, dict) or not all(isinstance(key, str) for key in template_kwargs):
        raise bad_request("Invalid type for 'chat_template_kwargs': expected an object with string keys",
                          param="chat_template_kwargs", code="invalid_type")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: these are arguments "
                          "of the template call, not template variables", param="chat_template_kwargs")


def parse_reasoning(body: dict[str, Any], template_kwargs: dict[str, Any] | None) -> tuple[dict[str, Any] | None,
                                                                                            int | None]:
    """`enable_thinking`, `reasoning_effort` and `thinking_budget` → (chat_template_kwargs, thinking budget).

    `enable_thinking` (top level, as vLLM and mlx-openai-server take it) wins over the
    same key in `chat_template_kwargs`; `reasoning_effort: "none"` turns thinking off.
    `template_kwargs` (the request's `chat_template_kwargs`) is checked first (`check_template_kwargs`).
    """
    check_template_kwargs(template_kwargs)
    kwargs = dict(template_kwargs or {})
    effort = get_field(body, "reasoning_effort", (str,))
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"Invalid value for 'reasoning_effort': {effort!r}; expected one of "
                              f"{list(REASONING_EFFORTS)}", param="reasoning_effort", code="invalid_value")
        kwargs.setdefault("enable_thinking", effort != "none")
        kwargs.setdefault("reasoning_effort", effort)
    enable = get_field(body, "enable_thinking", (bool,))
    if enable is not None:
        kwargs["enable_thinking"] = enable
    budget = get_field(body, "thinking_budget", (int,), minimum=0)
    return (kwargs or None), budget
