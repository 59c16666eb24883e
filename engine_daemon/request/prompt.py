"""A request's prompt as token ids: chat messages through the model's template, or raw text/ids."""

from __future__ import annotations

import json
from typing import Any

from engine_daemon.errors import RequestError, describe
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.request import client_template
from engine_daemon.request.template_kwargs import checked_template_kwargs
from engine_daemon.sampling.tool_choice import allowed_tools, narrowed


def build_prompt(loaded: LoadedModel, body: dict[str, Any]) -> list[int]:
    """Token ids of the prompt: chat messages through the model's template, or raw text/ids."""
    tokenizer = loaded.tokenizer
    messages = body.get("messages")
    if messages is not None:
        if not getattr(tokenizer, "has_chat_template", True):
            raise RequestError(400, "chat_template_missing",
                               f"Model '{loaded.ref.id}' has no chat template; use /v1/completions",
                               param="messages")
        kwargs = checked_template_kwargs(body.get("chat_template_kwargs"))
        tools = rendered_tools(body)
        if tools:
            kwargs["tools"] = tools
        if "chat_template" in kwargs:  # the client's own template (--allow-request-chat-template)
            text = client_template.render(kwargs.pop("chat_template"), {
                **kwargs, "messages": template_messages(messages), "add_generation_prompt": True,
                "bos_token": getattr(tokenizer, "bos_token", None) or "",
                "eos_token": getattr(tokenizer, "eos_token", None) or ""})
            return list(tokenizer.encode(text, add_special_tokens=False))
        try:
            tokens = tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                                   **kwargs)
        except Exception as exc:  # jinja raises its own exception types for template errors
            if isinstance(exc, RecursionError):  # the front-ends bound nesting (`MAX_NESTING`): a last guard
                raise RequestError(400, "invalid_messages", "The chat template could not render the messages: "
                                   "values in them (tool-call arguments, tool schemas) are nested too deeply",
                                   param="messages") from None
            folded = fold_late_system_turns(messages)
            if folded is None:
                raise RequestError(400, "invalid_messages", "The chat template rejected the messages: "
                                   f"{describe(exc)}", param="messages") from None
            return build_prompt(loaded, {**body, "messages": folded})
        return list(tokens)
    prompt = body["prompt"]
    if isinstance(prompt, list):
        return prompt
    return list(tokenizer.encode(prompt))


def fold_late_system_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Messages with every system turn after the first message folded into the next user turn (or the
    previous turn when none follows), for templates that take a system turn only at the start; None
    when there is none to fold. Clients such as Claude Code send system turns mid-conversation."""
    if not any(m.get("role") == "system" for m in messages[1:]):
        return None
    folded: list[dict[str, Any]] = []
    pending: list[str] = []
    for index, message in enumerate(messages):
        if index > 0 and message.get("role") == "system":
            pending.append(str(message.get("content") or ""))
            continue
        if pending and message.get("role") == "user" and isinstance(message.get("content"), str):
            message = {**message, "content": "\n\n".join(pending + [message["content"]])}
            pending = []
        folded.append(message)
    if pending and folded and isinstance(folded[-1].get("content"), str):
        folded[-1] = {**folded[-1], "content": "\n\n".join([folded[-1]["content"], *pending])}
    return folded


def template_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools the template describes; `tool_choice: "none"` means the model is not offered any.

    `allowed_tools` in mode "auto" describes only the allowed ones (`engine_daemon.sampling.tool_choice`).
    """
    choice = body.get("tool_choice")
    if choice == "none":
        return None
    allowed = allowed_tools(choice)
    if allowed is not None and allowed[0] == "auto":
        return narrowed(body.get("tools"), allowed[1]) or None
    return body.get("tools") or None


def rendered_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools the template lists: `template_tools` but those sent with `defer_loading` (Claude Code's
    tool search). A deferred tool is described where a tool search loaded it (the front-end writes its
    definition into that tool result), so the prompt's head, and its prefix-cache entry, never change
    as tools load, and unloaded tools cost no context. The output parser and a forced call's grammar
    still know every tool (`template_tools`)."""
    tools = template_tools(body) or []
    listed = [tool for tool in tools if not tool.get("defer_loading")]
    if not listed:  # every tool deferred: the template needs them to show how calls are written
        listed = [{key: value for key, value in tool.items() if key != "defer_loading"} for tool in tools]
    return listed or None


def _arguments_object(arguments: Any) -> Any:
    """Templates render arguments with `tojson`: give them the object, not its JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as chat templates expect them (tool-call arguments as objects)."""
    prepared = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**call, "function": {**call.get("function", {}),
                                      "arguments": _arguments_object(call.get("function", {}).get("arguments"))}}
                for call in calls if isinstance(call, dict)]}
        prepared.append(message)
    return prepared
