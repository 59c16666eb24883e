"""Forced tool calls cut by max_tokens, and parallel calls, over Chat, Responses and Messages (real processes).

A call cut short comes back as a call with its partial arguments (OpenAI's behaviour):
Chat `finish_reason: "length"`, Responses `status: "incomplete"`, Messages `stop_reason:
"max_tokens"`, streamed and not alike; never `<tool_call>` markup in any text. Between
parallel calls the model's newlines are not text. The forced call is grammar-constrained,
so its shape is deterministic even with random weights.
"""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.helpers import Frontend, client_for
from tests.stack.test_tools_reasoning import TOOLS

QUESTION = "What is the weather in Paris?"
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


def no_markup(*texts: str | None) -> None:
    for text in texts:
        assert "<tool_call>" not in (text or "") and "</tool_call>" not in (text or ""), text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_cut_call_is_a_partial_call(frontend: Frontend, model_id: str, stream: bool) -> None:
    result = client_for(frontend).chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, tool_choice="required",
        max_tokens=16, temperature=0, stream=stream, parallel_tool_calls=False)
    if stream:
        chunks = [c for c in result if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
    else:
        content, calls, finish = (result.choices[0].message.content, result.choices[0].message.tool_calls or [],
                                  result.choices[0].finish_reason)
    assert finish == "length" and not content
    (call,) = calls
    assert call.function.name == "get_weather"  # its arguments: as far as they got (here: not begun)
    no_markup(content, call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_cut_call_is_incomplete(frontend: Frontend, model_id: str, stream: bool) -> None:
    client = client_for(frontend)
    kwargs = dict(model=model_id, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required",
                  max_output_tokens=16, temperature=0, parallel_tool_calls=False)
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        response = events[-1].response
        assert events[-1].type == "response.incomplete"
    else:
        response = client.responses.create(**kwargs)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["function_call"]
    (call,) = response.output
    assert call.name == "get_weather" and call.status == "incomplete"
    no_markup(call.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_cut_call_stops_at_max_tokens(frontend: Frontend, model_id: str, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0)
    kwargs = dict(model=model_id, max_tokens=16, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                  messages=[{"role": "user", "content": QUESTION}])
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    assert [block.type for block in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather" and isinstance(message.content[0].input, dict)


def test_parallel_calls_are_nothing_but_calls(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    common = dict(model=model_id, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                  tool_choice="required", max_tokens=160, temperature=0)
    whole = client.chat.completions.create(**common)
    assert len(whole.choices[0].message.tool_calls) >= 2
    assert not whole.choices[0].message.content  # no "\n" between the calls
    chunks = [c for c in client.chat.completions.create(stream=True, **common) if c.choices]
    assert not any(c.choices[0].delta.content for c in chunks)
    response = client.responses.create(model=model_id, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required",
                                        max_output_tokens=160, temperature=0)
    assert {item.type for item in response.output} == {"function_call"} and len(response.output) >= 2
    message = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0).messages.create(
        model=model_id, max_tokens=160, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": QUESTION}])
    assert {block.type for block in message.content} == {"tool_use"} and len(message.content) >= 2


def test_call_cut_inside_its_arguments_agrees_on_every_api(frontend: Frontend, model_id: str) -> None:
    """max_tokens 24 stops inside the `city` string: the same partial arguments everywhere, streamed and not."""
    client = client_for(frontend)
    chat = dict(model=model_id, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, tool_choice="required",
                max_tokens=24, temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**chat).choices[0]
    (call,) = whole.message.tool_calls
    arguments = call.function.arguments
    assert whole.finish_reason == "length" and arguments.startswith('{"city": "') and not arguments.endswith("}")
    chunks = [c for c in client.chat.completions.create(stream=True, **chat) if c.choices]
    assert "".join(tc.function.arguments for c in chunks for tc in c.choices[0].delta.tool_calls or []) == arguments
    assert not any(c.choices[0].delta.content for c in chunks)

    responses = dict(model=model_id, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required",
                     max_output_tokens=24, temperature=0, parallel_tool_calls=False)
    events = list(client.responses.create(stream=True, **responses))
    assert not [e.type for e in events if e.type.startswith("response.output_text")]
    for response in (client.responses.create(**responses), events[-1].response):
        (item,) = response.output
        assert (item.arguments, item.status, response.status) == (arguments, "incomplete", "incomplete")

    messages = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0).messages
    kwargs = dict(model=model_id, max_tokens=24, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                  extra_body={"temperature": 0}, messages=[{"role": "user", "content": QUESTION}])
    returned = messages.create(**kwargs)
    with messages.stream(**kwargs) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert set(kinds) == {"input_json_delta"} and len(kinds) > 1  # no text_delta; the input streamed in pieces
    for message in (returned, streamed):
        assert message.stop_reason == "max_tokens" and [b.type for b in message.content] == ["tool_use"]
        # `input`: the fields written so far, the cut string closed where it stopped.
        assert message.content[0].input == {"city": json.loads(arguments + '"}')["city"]}


def test_call_cut_before_its_name_is_no_call_and_no_text(frontend: Frontend, model_id: str) -> None:
    """max_tokens 8 stops inside `"name"`: nothing to return, and never the markup as text."""
    client = client_for(frontend)
    chat = dict(model=model_id, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, tool_choice="required",
                max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**chat).choices[0]
    assert whole.finish_reason == "length" and not whole.message.content and not whole.message.tool_calls
    chunks = [c for c in client.chat.completions.create(stream=True, **chat) if c.choices]
    assert not any(c.choices[0].delta.content or c.choices[0].delta.tool_calls for c in chunks)
    response = client.responses.create(model=model_id, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required",
                                       max_output_tokens=8, temperature=0)
    assert response.status == "incomplete" and response.output_text == ""
    assert {item.type for item in response.output} <= {"message"}
    message = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0).messages.create(
        model=model_id, max_tokens=8, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
        extra_body={"temperature": 0}, messages=[{"role": "user", "content": QUESTION}])
    assert message.stop_reason == "max_tokens" and message.content == []


def test_parallel_calls_streamed_are_nothing_but_calls(frontend: Frontend, model_id: str) -> None:
    """Streamed, as `test_parallel_calls_are_nothing_but_calls`: no whitespace item, delta or block between calls."""
    events = list(client_for(frontend).responses.create(
        model=model_id, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=160,
        temperature=0, stream=True))
    assert not [e.type for e in events if e.type.startswith("response.output_text")]
    output = events[-1].response.output
    assert {item.type for item in output} == {"function_call"} and len(output) >= 2
    with anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0).messages.stream(
            model=model_id, max_tokens=160, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
            extra_body={"temperature": 0}, messages=[{"role": "user", "content": QUESTION}]) as stream:
        starts = [event.content_block.type for event in stream if event.type == "content_block_start"]
        message = stream.get_final_message()
    assert set(starts) == {"tool_use"} and len(starts) >= 2
    assert [block.type for block in message.content] == starts
