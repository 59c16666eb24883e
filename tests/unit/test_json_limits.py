"""Fuzzing: tool-call arguments holding an escaped lone surrogate, and JSON nested 100,000 levels deep (in
`arguments` or in the body), got 400s that named nothing ("TextEncodeInput must be Union[...]", "The chat
template rejected the messages: maximum recursion depth exceeded", "The request body is nested too deeply").
Now each says what is wrong and where, as a param path, in each route's envelope (front-end, fake engine)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from http_frontend.parsing.json_limits import MAX_NESTING, max_depth, path_past, show_path
from tests.unit.fake_engine import FakeEngine, client_for

JSON = {"content-type": "application/json"}
LONE = '{"a": "\\ud800"}'  # JSON text whose string is an escaped lone high surrogate
DEEP = "[" * 100_000 + "]" * 100_000
DEEP_PATH = "[0].[0].[0].[0].[0].[0].[0].[0].…(246 more levels)….[0].[0]"


def chat(arguments: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


def responses(arguments: str) -> dict[str, Any]:
    return {"model": "m", "input": [{"role": "user", "content": "hi"},
                                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
                                    {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}


def messages(tool_input: str) -> str:
    """An Anthropic body whose tool_use `input` is the raw JSON `tool_input`."""
    body = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": "X"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}
    return json.dumps(body).replace('{"a": "X"}', tool_input)


def post(engine: FakeEngine, path: str, body: dict[str, Any] | str):
    raw = body if isinstance(body, str) else json.dumps(body)
    return client_for(engine).simulate_post(path, body=raw, headers=JSON)


def openai_error(result: Any) -> dict[str, Any]:
    assert result.status_code == 400, result.text
    assert set(result.json) == {"error"} and result.json["error"]["type"] == "invalid_request_error"
    return result.json["error"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", chat(LONE), "messages.[1].tool_calls.[0].function.arguments"),
    ("/v1/responses", responses(LONE), "input[1].arguments"),
])
def test_arguments_with_an_escaped_lone_surrogate_are_a_400_naming_them(path: str, body: dict, param: str) -> None:
    engine = FakeEngine()
    error = openai_error(post(engine, path, body))  # was a 200 here, then the tokenizer's TextEncodeInput error
    assert error["param"] == param and error["code"] == "invalid_value"
    assert error["message"].startswith(f"Invalid '{param}': its JSON holds the escape '\\ud800', a lone UTF-16 "
                                       "surrogate, which is not valid Unicode")
    assert engine.added == []


@pytest.mark.parametrize("arguments", ['{"a": "\\ud83d\\ude00"}', "not JSON: \\ud800", '{"a": "\\\\ud800"}'])
def test_paired_escapes_and_text_that_is_not_json_pass(arguments: str) -> None:
    """A surrogate pair is one character; arguments that are not JSON reach the template as text; an escaped
    backslash before `ud800` is no escape at all."""
    engine = FakeEngine()
    assert post(engine, "/v1/chat/completions", chat(arguments)).status_code == 200
    assert engine.added[-1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == arguments


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", chat(DEEP), "messages.[1].tool_calls.[0].function.arguments"),
    ("/v1/responses", responses(DEEP), "input[1].arguments"),
])
def test_arguments_nested_100000_deep_are_a_400_naming_them(path: str, body: dict, param: str) -> None:
    engine = FakeEngine()
    error = openai_error(post(engine, path, body))  # was a 200 here, then "maximum recursion depth exceeded"
    assert error["param"] == param and error["code"] == "invalid_value"
    assert error["message"] == (f"Invalid '{param}': its JSON (at '{DEEP_PATH}') nests arrays and objects more "
                                f"than {MAX_NESTING} levels deep there; at most {MAX_NESTING} levels are allowed")
    assert engine.added == []


def test_arguments_up_to_the_limit_pass() -> None:
    engine = FakeEngine()
    depth = MAX_NESTING
    assert post(engine, "/v1/chat/completions", chat("[" * depth + "]" * depth)).status_code == 200
    deeper = "[" * (depth + 1) + "]" * (depth + 1)
    assert post(engine, "/v1/chat/completions", chat(deeper)).status_code == 400
    # Brackets inside strings are text, not nesting.
    assert post(engine, "/v1/chat/completions", chat(json.dumps({"code": "[" * 5000}))).status_code == 200


@pytest.mark.parametrize("path,prefix", [("/v1/chat/completions", '{"model": "m", "messages": [], "metadata": '),
                                         ("/v1/responses", '{"model": "m", "input": "hi", "metadata": '),
                                         ("/v1/messages", '{"model": "m", "max_tokens": 4, "metadata": ')])
def test_a_body_nested_100000_deep_is_a_400_naming_where(path: str, prefix: str) -> None:
    engine = FakeEngine()
    result = post(engine, path, prefix + DEEP + "}")
    where = show_path(["metadata"] + [0] * (MAX_NESTING - 1))  # the body's object is the first level
    assert where == "metadata.[0].[0].[0].[0].[0].[0].[0].…(246 more levels)….[0].[0]"
    message = (f"Invalid '{where}': the request body nests arrays and objects more than {MAX_NESTING} "
               f"levels deep there; at most {MAX_NESTING} levels are allowed")
    if path == "/v1/messages":
        assert result.status_code == 400
        assert result.json == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    else:
        error = openai_error(result)
        assert (error["message"], error["param"], error["code"]) == (message, where, "invalid_json")
    assert engine.added == []


def test_anthropic_tool_use_input_deep_or_with_a_lone_surrogate_is_named_in_anthropics_envelope() -> None:
    engine = FakeEngine()
    deep = post(engine, "/v1/messages", messages('{"a": ' + DEEP + "}"))
    assert deep.status_code == 400 and deep.json["type"] == "error"
    assert deep.json["error"]["message"].startswith(
        "Invalid 'messages.[1].content.[0].input.a.[0].[0].…(246 more levels)….[0].[0]': the request body "
        f"nests arrays and objects more than {MAX_NESTING} levels deep")
    lone = post(engine, "/v1/messages", messages(LONE))  # the escape in the body itself, not in a string's JSON
    assert lone.status_code == 400 and lone.json["error"] == {
        "type": "invalid_request_error", "message": "Invalid value for 'messages.[1].content.[0].input.a': a string "
                                                    "holds a lone UTF-16 surrogate ('\\ud800'), which is not valid "
                                                    "Unicode"}
    assert engine.added == []


def test_depth_and_path_are_found_without_parsing() -> None:
    assert max_depth(b'{"a": "[[[[[[", "b": [1, {"c": []}]}', limit=0) == 4
    assert max_depth(b'{"a": "\\"[[[[[["}', limit=0) == 1  # an escaped quote does not end the string
    raw = b'{"k\\"x": [1, "]", {"z": {"y": [[[' + b"[" * 50_000
    assert show_path(path_past(raw, limit=5)) == 'k"x.[2].z.y.[0]'
    assert max_depth(b"[" * 10 + b"]" * 10, limit=100) == 0  # too few brackets to pass the limit: not measured


def test_the_engine_names_a_template_recursion_as_nesting() -> None:
    """The last guard, behind the front-end's limit: a template that recursed too deep is a 400 that says why,
    not "The chat template rejected the messages: maximum recursion depth exceeded in comparison"."""
    from types import SimpleNamespace

    from engine_daemon.errors import RequestError
    from engine_daemon.request.prompt import build_prompt

    def recurse(*args: Any, **kwargs: Any) -> list[int]:
        raise RecursionError("maximum recursion depth exceeded in comparison")

    loaded = SimpleNamespace(tokenizer=SimpleNamespace(apply_chat_template=recurse), ref=SimpleNamespace(id="m"))
    with pytest.raises(RequestError) as caught:
        build_prompt(loaded, {"messages": chat("[]")["messages"]})
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "invalid_messages", "messages")
    assert "nested too deeply" in str(caught.value)
