"""Anthropic Messages through the real stack: anthropic SDK -> gunicorn -> engined -> MLX.

Plus the translation and block-building pieces on their own, where a table of inputs
says more than a server round trip would. This SDK version takes sampling fields
through `extra_body` (its `create` has no `temperature`), as any client may send them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from model_builders.text import derive_model
from model_builders.tokenizer import thinking_chat_template
from tests.helpers import Frontend

GREEDY = {"temperature": 0}
PROMPT = [{"role": "user", "content": "Tell me a story about a fox."}]
TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                           "required": ["city"]}}]


def client_for(frontend: Frontend) -> anthropic.Anthropic:
    # The SDK appends /v1/messages to base_url itself.
    return anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=60)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def check_grammar(events: list[Any]) -> None:
    """message_start, then per block start / delta* / stop in index order, message_delta, message_stop."""
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    index = -1
    open_block = None
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_block is None and e.index == index + 1, types
            index = open_block = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_block, types
        else:
            assert e.type == "content_block_stop" and e.index == open_block, types
            open_block = None
    assert open_block is None, types


# -- end to end ------------------------------------------------------------------------------------

def test_message_and_its_streams_agree(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    result = client.messages.create(model=model_id, max_tokens=20, messages=PROMPT, extra_body=GREEDY)
    assert result.type == "message" and result.role == "assistant" and result.id.startswith("msg_")
    assert result.model == model_id
    assert [block.type for block in result.content] == ["text"]
    assert result.stop_reason in ("end_turn", "max_tokens") and result.stop_sequence is None
    assert result.usage.output_tokens > 0 and result.usage.input_tokens + result.usage.cache_read_input_tokens > 0
    text = text_of(result)
    assert text

    events = list(client.messages.create(model=model_id, max_tokens=20, messages=PROMPT, stream=True,
                                         extra_body=GREEDY))
    check_grammar(events)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert events[-2].delta.stop_reason == result.stop_reason
    assert events[-2].usage.output_tokens == result.usage.output_tokens
    assert events[0].message.id.startswith("msg_") and events[0].message.content == []

    with client.messages.stream(model=model_id, max_tokens=20, messages=PROMPT, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text
    assert final.stop_reason == result.stop_reason


def test_raw_sse_names_every_event_and_pings(frontend: Frontend, model_id: str) -> None:
    body = {"model": model_id, "max_tokens": 6, "messages": PROMPT, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{frontend.base_url}/v1/messages", json=body, timeout=60,
                      headers={"anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = [frame for frame in raw.split("\n\n") if frame.strip()]
    names = []
    for frame in frames:
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        assert json.loads(lines["data"])["type"] == lines["event"]
        names.append(lines["event"])
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert "[DONE]" not in raw


def test_a_vanished_stream_client_frees_the_engine(frontend: Frontend, model_id: str) -> None:
    before = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
    body = {"model": model_id, "max_tokens": 3000, "messages": PROMPT, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{frontend.base_url}/v1/messages", json=body, timeout=60) as response:
        lines = response.iter_lines()
        while "content_block_delta" not in next(lines):
            pass
    deadline = time.monotonic() + 120  # a bound on the wait: the engine's counters below are the check
    while True:
        stats = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
        if stats["running"] == 0 and stats["queued"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["queued"] == 0, stats
    assert stats["requests_aborted"] > before["requests_aborted"], stats  # aborted, not run to its end
    assert stats["tokens_generated"] - before["tokens_generated"] < 3000, stats


def test_max_tokens_and_stop_sequences(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    full = client.messages.create(model=model_id, max_tokens=24, messages=PROMPT, extra_body=GREEDY)
    text = text_of(full)
    assert full.usage.output_tokens > 4, "the reference output is too short to cut"
    short = client.messages.create(model=model_id, max_tokens=4, messages=PROMPT, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 4
    assert text.startswith(text_of(short))

    # A stop sequence greedy decoding is known to produce, after some text.
    stop = next(text[i:i + 3] for i in range(2, len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in
                text[i:i + 3])
    stops = ["\u0000never", stop]
    stopped = client.messages.create(model=model_id, max_tokens=24, messages=PROMPT, stop_sequences=stops,
                                     extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == text[:text.index(stop)]
    events = list(client.messages.create(model=model_id, max_tokens=24, messages=PROMPT, stop_sequences=stops,
                                         stream=True, extra_body=GREEDY))
    check_grammar(events)
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", stop)
    # Without a match the reason stays end_turn / max_tokens and stop_sequence null.
    unmatched = client.messages.create(model=model_id, max_tokens=4, messages=PROMPT,
                                       stop_sequences=["\u0000never"], extra_body=GREEDY)
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("max_tokens", None)


def test_count_tokens_matches_usage(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    request = {"model": model_id, "system": [{"type": "text", "text": "You are terse."}], "messages": PROMPT}
    counted = client.messages.count_tokens(**request).input_tokens
    result = client.messages.create(max_tokens=2, **request)
    assert counted == result.usage.input_tokens + result.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(tools=TOOLS, **request).input_tokens
    used = client.messages.create(max_tokens=2, tools=TOOLS, **request).usage
    assert with_tools > counted  # tool definitions are part of the prompt
    assert with_tools == used.input_tokens + used.cache_read_input_tokens
    # A prompt whose bytes cannot fit the window is refused by its size, not tokenized (it held the engine's
    # admission threads for seconds: every other request waited).
    huge = [{"role": "user", "content": "a b " * 3_000_000}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model=model_id, messages=huge)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "context length" in caught.value.body["error"]["message"]


def test_errors_come_in_anthropic_shape(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model_id, max_tokens=8, messages=PROMPT, extra_body={"max_tokens": None})
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in caught.value.body["error"]["message"]

    url = f"{frontend.base_url}/v1/messages"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    for body in ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
                 {"max_tokens": 4, "messages": PROMPT, "temperature": 1.5},
                 {"max_tokens": 4, "messages": [{"role": "user", "content": [image]}]},
                 {"max_tokens": 4, "messages": PROMPT, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
                 {"max_tokens": 4, "messages": PROMPT, "thinking": {"type": "enabled", "budget_tokens": 4}}):
        response = httpx.post(url, json={"model": model_id, **body}, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{url}/nope", json={}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    counted = httpx.post(f"{url}/count_tokens", json={"model": model_id, "messages": []}, timeout=30)
    assert counted.status_code == 400 and counted.json()["type"] == "error"
    # OpenAI routes keep OpenAI's envelope.
    openai_error = httpx.post(f"{frontend.base_url}/v1/chat/completions", json={"model": model_id}, timeout=30)
    assert openai_error.status_code == 400 and openai_error.json()["error"]["param"] == "messages"


def test_tool_use_round_trip(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    ask = {"model": model_id, "max_tokens": 60, "tools": TOOLS,
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "extra_body": GREEDY}
    result = client.messages.create(**ask)
    assert result.stop_reason == "tool_use", result
    calls = [block for block in result.content if block.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and calls[0].input.get("city") in ("Paris", "Rome")
    assert calls[0].id and not text_of(result).strip()

    events = list(client.messages.create(stream=True, **ask))
    check_grammar(events)
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(c.name, c.input) for c in calls]

    single = client.messages.create(**{**ask, "tool_choice": {"type": "tool", "name": "get_weather",
                                                              "disable_parallel_tool_use": True}})
    assert [block.type for block in single.content] == ["tool_use"] and single.stop_reason == "tool_use"

    answer = client.messages.create(
        model=model_id, max_tokens=8, tools=TOOLS, extra_body=GREEDY,
        messages=[*ask["messages"], {"role": "assistant", "content": [b.model_dump() for b in result.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                "content": [{"type": "text", "text": "18 C and sunny"}]}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.output_tokens > 0


def test_strict_tools_hold_forced_calls_to_their_schema(frontend: Frontend, model_id: str) -> None:
    """`strict: true` was dropped: a forced call to a tool whose schema does not close its objects could carry keys
    the schema never named. Strict now closes them, as Anthropic's strict tool use promises (its schemas say
    `additionalProperties: false`; one that does not is closed rather than refused)."""
    client = client_for(frontend)
    loose = {"type": "object", "properties": {"z": {"type": "string", "maxLength": 3}}}
    tools = [{"name": "f", "description": "Records a note.", "input_schema": loose, "strict": True}]
    for _ in range(4):  # sampled: each call another draw
        result = client.messages.create(model=model_id, max_tokens=60, messages=[{"role": "user", "content": "x"}],
                                        tools=tools, tool_choice={"type": "tool", "name": "f",
                                                                  "disable_parallel_tool_use": True},
                                        extra_body={"temperature": 1.0})
        (call,) = [block for block in result.content if block.type == "tool_use"]
        assert call.name == "f" and set(call.input) <= {"z"}, call.input
        assert len(call.input.get("z", "")) <= 3 and result.stop_reason == "tool_use"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model_id, max_tokens=4, messages=PROMPT, tools=[{**tools[0], "strict": "yes"}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["error"]["message"].startswith("tools.0.strict:")


def test_search_results_reach_the_model(frontend: Frontend, model_id: str) -> None:
    """`search_result` blocks (Anthropic's search results, in a user turn or a tool_result) were dropped: the model
    answered without what the client's search found. They now read as text where they were sent."""
    client = client_for(frontend)
    found = {"type": "search_result", "source": "https://example.com/foxes", "title": "Fox habitats",
             "content": [{"type": "text", "text": "Red foxes live in dens dug into banks and hillsides."}],
             "citations": {"enabled": True}}
    question = {"type": "text", "text": "Where do foxes live?"}
    plain = client.messages.count_tokens(model=model_id, messages=[{"role": "user", "content": [question]}])
    with_result = client.messages.count_tokens(model=model_id,
                                               messages=[{"role": "user", "content": [found, question]}])
    assert with_result.input_tokens > plain.input_tokens + 10  # the title, source and text are in the prompt
    reply = client.messages.create(model=model_id, max_tokens=4, messages=[{"role": "user", "content": [found]}])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > plain.input_tokens

    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search",
                                              "input": {"q": "foxes"}}]}
    tools = [{"name": "search", "description": "Searches the knowledge base.",
              "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]

    def counted(content: list[dict[str, Any]]) -> int:
        turns = [{"role": "user", "content": "Search for foxes"}, call,
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]}]
        return client.messages.count_tokens(model=model_id, tools=tools, messages=turns).input_tokens

    assert counted([found]) > counted([{"type": "text", "text": "none"}]) + 10
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model_id, max_tokens=4, messages=[{"role": "user", "content": [
            {**found, "content": [{"type": "text"}]}]}])
    assert caught.value.body["error"]["message"].startswith("messages.0.content.0.content.0:")


def test_the_memory_tool_is_offered_and_called_by_its_name(frontend: Frontend, model_id: str) -> None:
    """Anthropic's memory tool (`memory_20250818`, a client tool) was left out as a hosted one: a request forcing it
    was a 400 and the model never saw it. It is offered with the documented command inputs; calls come back as
    `tool_use` blocks named `memory`, holding only those inputs."""
    client = client_for(frontend)
    documented = {"command", "path", "view_range", "file_text", "old_str", "new_str", "insert_line", "insert_text",
                  "old_path", "new_path"}
    tools = [{"type": "memory_20250818", "name": "memory"}]
    messages = [{"role": "user", "content": "Remember that I like foxes."}]
    plain = client.beta.messages.count_tokens(model=model_id, messages=messages).input_tokens
    assert client.beta.messages.count_tokens(model=model_id, messages=messages, tools=tools).input_tokens > plain + 50
    # The random model, greedy, writes one string value on and on: the call is cut by max_tokens (and closed).
    result = client.beta.messages.create(model=model_id, max_tokens=40, messages=messages, tools=tools,
                                         tool_choice={"type": "tool", "name": "memory",
                                                      "disable_parallel_tool_use": True},
                                         betas=["context-management-2025-06-27"], extra_body=GREEDY)
    (call,) = [block for block in result.content if block.type == "tool_use"]
    assert call.name == "memory" and result.stop_reason in ("tool_use", "max_tokens"), result
    assert call.input["command"] in ("view", "create", "str_replace", "insert", "delete", "rename")
    assert set(call.input) <= documented, call.input


@pytest.fixture(scope="module")
def thinking_model(tiny_model: Path) -> str:
    # Next to the tiny model: the engine serves paths under its --model's directory.
    return str(derive_model(tiny_model, tiny_model.parent / "tiny-thinking-messages", thinking_chat_template()))


def test_thinking_blocks(frontend: Frontend, thinking_model: str) -> None:
    client = client_for(frontend)
    ask = {"model": thinking_model, "max_tokens": 12, "messages": PROMPT,
           "thinking": {"type": "enabled", "budget_tokens": 4}, "extra_body": {**GREEDY, "ignore_eos": True}}
    result = client.messages.create(**ask)
    assert [block.type for block in result.content] == ["thinking", "text"]
    assert result.content[0].thinking and result.content[0].signature == "" and result.content[1].text
    assert "think>" not in result.content[0].thinking + result.content[1].text
    events = list(client.messages.create(stream=True, **ask))
    check_grammar(events)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == result.content[0].thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == result.content[1].text

    off = client.messages.create(**{**ask, "thinking": {"type": "disabled"}})
    assert [block.type for block in off.content] == ["text"]


# -- translation and rendering ----------------------------------------------------------------------




def test_system_turns_inside_messages_are_accepted(frontend: Frontend, model_id: str) -> None:
    """Claude Code sends `{"role": "system"}` turns inside `messages` (beta mid-conversation-system): not a 400."""
    client = client_for(frontend)
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
             {"role": "system", "content": [{"type": "text", "text": "Agents available: explorer, planner."}]},
             {"role": "user", "content": "plan it"}]
    plain = [turn for turn in turns if turn["role"] != "system"]
    result = client.messages.create(model=model_id, max_tokens=4, messages=turns,
                                    extra_headers={"anthropic-beta": "mid-conversation-system-2026-04-07"})
    with_system = client.messages.count_tokens(model=model_id, messages=turns).input_tokens  # the loaded model
    assert result.usage.input_tokens + result.usage.cache_read_input_tokens == with_system
    assert with_system > client.messages.count_tokens(model=model_id, messages=plain).input_tokens


def test_deferred_tools_cost_no_context_until_a_tool_search_loads_them(frontend: Frontend, model_id: str) -> None:
    """Claude Code's tool search: tools sent with `defer_loading` were all rendered in the prompt (a long MCP
    list could fill a local model's window). Now only the others are listed; a `tool_reference` writes the
    deferred tool's definition where the search put it, so the prompt's head stays the same as tools load."""
    client = client_for(frontend)
    query = {"name": "mcp__db__query", "description": "Runs one read-only SQL query on the analytics database.",
             "input_schema": {"type": "object", "properties": {"sql": {"type": "string", "maxLength": 12}},
                              "required": ["sql"], "additionalProperties": False}}
    search = {"name": "ToolSearch", "description": "Finds deferred tools.",
              "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
    request = {"model": model_id, "messages": PROMPT}
    listed = client.messages.count_tokens(tools=[search, query], **request).input_tokens
    deferred = client.messages.count_tokens(tools=[search, {**query, "defer_loading": True}], **request).input_tokens
    alone = client.messages.count_tokens(tools=[search], **request).input_tokens
    assert deferred == alone < listed
    loaded = [*PROMPT, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                                          "input": {"query": "select:mcp__db__query"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                            "content": [{"type": "tool_reference", "tool_name": "mcp__db__query"}]}]}]
    tools = [search, {**query, "defer_loading": True}]
    with_reference = client.messages.count_tokens(model=model_id, tools=tools, messages=loaded).input_tokens
    without_definition = client.messages.count_tokens(model=model_id, tools=[search], messages=loaded).input_tokens
    assert with_reference > without_definition  # the definition is in the tool result
    # The engine still knows the deferred tool: a call forced to it follows its schema.
    forced = client.messages.create(model=model_id, max_tokens=40, tools=tools, messages=loaded,
                                    tool_choice={"type": "tool", "name": "mcp__db__query"},
                                    extra_body={"temperature": 0})
    (block,) = [b for b in forced.content if b.type == "tool_use"]
    assert block.name == "mcp__db__query" and isinstance(block.input["sql"], str)
    # The turn after the search reuses the prompt cached before it: the tools' part did not change.
    first = client.messages.create(model=model_id, max_tokens=1, tools=tools, messages=PROMPT)
    second = client.messages.create(model=model_id, max_tokens=1, tools=tools, messages=loaded)
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens - 2
