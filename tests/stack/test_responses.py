"""The Responses API through the real stack (openai SDK -> gunicorn -> engined), and its engine-side store.

Random weights make the text nonsense, so determinism comes from greedy decoding,
from stop strings cut out of an earlier greedy answer, from constrained decoding
(json_schema, forced tool calls) and from the thinking variant of the tiny model.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from model_builders.text import derive_model
from model_builders.tokenizer import thinking_chat_template
from tests.helpers import Engine, Frontend, client_for, data_url, png
from tests.unit.test_responses_translation import TEXT_DONE, TEXT_EVENTS, collapse

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
          "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["C", "F"]}},
                         "required": ["unit"], "additionalProperties": False}}]


# -- through the real stack -------------------------------------------------------------------

def test_string_input_non_streaming(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    result = client.responses.create(model=model_id, input="Tell me a story.", max_output_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert result.object == "response" and result.id.startswith("resp_")
    assert result.status == "incomplete" and result.incomplete_details.reason == "max_output_tokens"
    (message,) = result.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and result.output_text == message.content[0].text
    assert result.output_text
    assert result.usage.output_tokens == 6 and result.usage.input_tokens > 0
    assert result.usage.total_tokens == result.usage.input_tokens + 6
    assert result.max_output_tokens == 6 and result.temperature == 0 and result.store is True


def test_items_and_instructions(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    items = [{"role": "user", "content": "What is 2 + 2?"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And 3 + 3?"}]}]
    plain = client.responses.create(model=model_id, input=items, max_output_tokens=4, temperature=0)
    instructed = client.responses.create(model=model_id, input=items, instructions="Answer in French.",
                                         max_output_tokens=4, temperature=0)
    as_system = client.responses.create(model=model_id, max_output_tokens=4, temperature=0,
                                        input=[{"role": "system", "content": "Answer in French."}, *items])
    assert instructed.instructions == "Answer in French."
    # The template's default system prompt is replaced by the instructions, as by a system message.
    assert instructed.usage.input_tokens == as_system.usage.input_tokens != plain.usage.input_tokens
    assert instructed.output_text == as_system.output_text


def _stream_events(client: openai.OpenAI, **request: Any) -> list[Any]:
    with client.responses.create(stream=True, **request) as stream:
        return list(stream)


def test_stream_event_order_and_sequence(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    request = {"model": model_id, "input": "Count from one to ten.", "max_output_tokens": 12, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    full = client.responses.create(**request).output_text
    # A stop string cut from the greedy answer ends the same request early with "stop": status completed.
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full
    expected_text = full[:full.index(stop)]
    request["extra_body"] = {"ignore_eos": True, "stop": [stop]}
    events = _stream_events(client, **request)
    types = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert expected_text, (full, stop)
    assert collapse(types) == ["response.created", "response.in_progress", *TEXT_EVENTS, *TEXT_DONE,
                               "response.completed"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == expected_text == events[-4].text
    created, completed = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert completed.id == created.id and completed.status == "completed" and completed.output_text == expected_text
    assert completed.usage.output_tokens >= len(deltas) and completed.usage.input_tokens > 0
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {completed.output[0].id}

    # Cut by max_output_tokens: the same shape, ending with response.incomplete as OpenAI's does.
    request["extra_body"] = {"ignore_eos": True}
    request["max_output_tokens"] = 3
    events = _stream_events(client, **request)
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert collapse([e.type for e in events]) == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                                  *TEXT_DONE, "response.incomplete"]


def test_stream_helper_and_no_done_marker(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    with client.responses.stream(model=model_id, input="Hi", max_output_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True}) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
    assert text
    raw = httpx.post(f"{frontend.base_url}/responses", timeout=30, json={
        "model": model_id, "input": "Hi", "max_output_tokens": 3, "stream": True, "ignore_eos": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in raw.text.split("\n\n") if b.strip() and not b.startswith(":")]
    assert "[DONE]" not in raw.text
    first = blocks[0].splitlines()
    assert first[0] == "event: response.created" and json.loads(first[1][len("data: "):])["sequence_number"] == 0


def test_previous_response_id_resumes_without_instructions(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    common = {"model": model_id, "max_output_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = client.responses.create(input="Tell me about foxes.", instructions="Be terse.", **common)
    second = client.responses.create(input="And wolves?", previous_response_id=first.id, **common)
    assert second.previous_response_id == first.id
    # The same conversation sent in full (OpenAI does not carry `instructions` over).
    explicit = client.responses.create(input=[
        {"role": "user", "content": "Tell me about foxes."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And wolves?"}], **common)
    assert second.usage.input_tokens == explicit.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == explicit.output_text
    # A chain of three: the third turn sees both earlier ones.
    third = client.responses.create(input="Thanks.", previous_response_id=second.id, **common)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_get_delete_and_not_found(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    created = client.responses.create(model=model_id, input="Hello", max_output_tokens=3, temperature=0)
    fetched = client.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    # Any worker answers: the store is in the engine, not in the front-end process.
    for _ in range(4):
        assert httpx.get(f"{frontend.base_url}/responses/{created.id}").json()["id"] == created.id
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    gone = httpx.delete(f"{frontend.base_url}/v1/responses/{created.id}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    missing = httpx.post(f"{frontend.base_url}/v1/responses", timeout=30, json={
        "model": model_id, "input": "Hi", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    unstored = client.responses.create(model=model_id, input="Hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_output_text_logprobs_match_chat_and_stream(frontend: Frontend, model_id: str) -> None:
    """`include: ["message.output_text.logprobs"]` (and `top_logprobs`): chat's entries, in the part and the deltas."""
    client = client_for(frontend)
    common = {"model": model_id, "max_output_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    result = client.responses.create(input="Tell me a story.", include=["message.output_text.logprobs"],
                                     top_logprobs=2, **common)
    part = result.output[0].content[0]
    assert len(part.logprobs) == 6 and result.top_logprobs == 2
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    assert b"".join(bytes(entry.bytes) for entry in part.logprobs).decode("utf-8", "replace").strip() == \
        part.text.strip()
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Tell me a story."}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    assert [e.token for e in part.logprobs] == [e.token for e in chat.choices[0].logprobs.content]
    events = list(client.responses.create(input="Tell me a story.", include=["message.output_text.logprobs"],
                                          stream=True, **common))
    deltas = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    (done,) = [event for event in events if event.type == "response.output_text.done"]
    assert [e.token for e in deltas] == [e.token for e in done.logprobs] == [e.token for e in part.logprobs]
    # Other `include` values (Codex sends "reasoning.encrypted_content") are accepted and add nothing.
    plain = client.responses.create(input="Tell me a story.", include=["reasoning.encrypted_content"], **common)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == result.output_text


def test_bad_fields_are_400s_naming_the_param(frontend: Frontend, model_id: str) -> None:
    base = {"model": model_id, "input": "hi", "max_output_tokens": 2}
    cases = [
        ({"temperature": "hot"}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
        ({"input": [{"type": "teleport_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"tools": [{"type": "teleport"}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"background": True}, "background"),
        ({"include": "message.output_text.logprobs"}, "include"),
        ({"include": [5]}, "include"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ]
    for extra, param in cases:
        response = httpx.post(f"{frontend.base_url}/v1/responses", json={**base, **extra}, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (extra, error)
    response = httpx.post(f"{frontend.base_url}/v1/responses", json={"model": model_id}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    # An integer msgpack cannot carry to the engine is refused up front (as the body is read), not a 500.
    response = httpx.post(f"{frontend.base_url}/v1/responses", json={**base, "metadata": {"n": 10**30}}, timeout=30)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("invalid_value", "metadata.n")


def test_json_schema_output(frontend: Frontend, model_id: str) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    client = client_for(frontend)
    result = client.responses.create(model=model_id, input="Is the sky blue?", text=text, max_output_tokens=40,
                                     temperature=0)
    assert result.status == "completed", result.output_text
    assert isinstance(json.loads(result.output_text)["ok"], bool)
    assert result.text.format.type == "json_schema"
    events = _stream_events(client, model=model_id, input="Is the sky blue?", text=text, max_output_tokens=40,
                            temperature=0)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == result.output_text


def test_function_call_and_its_output_round_trip(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    common = {"model": model_id, "tools": TOOLS, "temperature": 0, "parallel_tool_calls": False}
    question = "What is the weather in Paris?"
    called = client.responses.create(input=question, tool_choice="required", max_output_tokens=60, **common)
    assert called.status == "completed", called.output
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("fc_")
    assert json.loads(calls[0].arguments)["unit"] in ("C", "F")

    events = _stream_events(client, input=question, tool_choice="required", max_output_tokens=60, **common)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    tail = [e.type for e in events if "function_call" in e.type or e.type.startswith("response.output_item")]
    # The item opens when the call is named, its arguments stream in pieces, then the `.done`s.
    pieces = tail.count("response.function_call_arguments.delta")
    assert pieces > 1 and tail[:pieces + 3] == ["response.output_item.added",
                                                *["response.function_call_arguments.delta"] * pieces,
                                                "response.function_call_arguments.done", "response.output_item.done"]
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == calls[0].arguments and done.item_id == added.item.id
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
    assert events[-1].type == "response.completed"

    result = client.responses.create(
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}],
        previous_response_id=called.id, tool_choice="none", max_output_tokens=4, **common)
    explicit = client.responses.create(
        input=[{"role": "user", "content": question},
               *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                 for c in calls],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}],
        tool_choice="none", max_output_tokens=4, **common)
    alone = client.responses.create(input=question, tool_choice="none", max_output_tokens=4, **common)
    assert result.output[0].type == "message"  # tool_choice "none": the template offers no tools
    assert result.usage.input_tokens == explicit.usage.input_tokens > alone.usage.input_tokens
    assert result.output_text == explicit.output_text


@pytest.fixture(scope="module")
def thinking_model(tiny_model: Path) -> str:
    # Next to the tiny model: the engine serves paths under its --model's directory.
    return str(derive_model(tiny_model, tiny_model.parent / "tiny-thinking-responses", thinking_chat_template()))


def test_reasoning_item_and_events(frontend: Frontend, thinking_model: str) -> None:
    client = client_for(frontend)
    request = {"model": thinking_model, "input": "Is 7 prime?", "max_output_tokens": 10, "temperature": 0,
               "extra_body": {"thinking_budget": 3, "ignore_eos": True}}
    result = client.responses.create(**request)
    assert [item.type for item in result.output] == ["reasoning", "message"]
    reasoning = result.output[0].content[0].text
    assert reasoning and "think>" not in reasoning and result.output_text
    events = _stream_events(client, **request)
    assert collapse([e.type for e in events]) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        *TEXT_EVENTS, *TEXT_DONE, "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    # effort "none" renders the thinking block closed: no reasoning item.
    plain = client.responses.create(model=thinking_model, input="Is 7 prime?", max_output_tokens=4,
                                    temperature=0, reasoning={"effort": "none"}, extra_body={"ignore_eos": True})
    assert [item.type for item in plain.output] == ["message"]


@pytest.fixture(scope="module")
def vision_model(tiny_model: Path) -> str:
    from model_builders.vlm import build_vlm

    return str(build_vlm(tiny_model.parent / "tiny-vlm-responses", seed=1))


def test_input_image_and_its_resumed_conversation(frontend: Frontend, model_id: str, vision_model: str) -> None:
    """An input_image reaches the vision model; a later turn by previous_response_id still sees it."""
    client = client_for(frontend)
    common = {"max_output_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    turn = [{"role": "user", "content": [{"type": "input_text", "text": "Describe this image."},
                                         {"type": "input_image", "image_url": data_url(png(2, 56)),
                                          "detail": "auto"}]}]
    first = client.responses.create(model=vision_model, input=turn, **common)
    text_only = client.responses.create(model=vision_model, input="Describe this image.", **common)
    assert first.usage.input_tokens > text_only.usage.input_tokens  # the image's tokens
    second = client.responses.create(model=vision_model, input="And its colours?", previous_response_id=first.id,
                                     **common)
    explicit = client.responses.create(model=vision_model, **common, input=[
        *turn, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And its colours?"}])
    assert second.usage.input_tokens == explicit.usage.input_tokens
    assert second.output_text == explicit.output_text
    refused = httpx.post(f"{frontend.base_url}/v1/responses", timeout=60,
                         json={"model": model_id, "input": turn, "max_output_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "images_not_supported"


def test_a_client_leaving_mid_stream_frees_the_engine(frontend: Frontend, model_id: str) -> None:
    before = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
    body = {"model": model_id, "input": "Talk for a long time.", "max_output_tokens": 3000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{frontend.base_url}/v1/responses", json=body, timeout=60) as response:
        deltas = 0
        for line in response.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
    deadline = time.monotonic() + 120  # a bound on the wait: the engine's counters below are the check
    while True:
        stats = httpx.get(f"{frontend.base_url}/stats", timeout=10).json()
        if stats["running"] == 0 and stats["queued"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["queued"] == 0, stats
    assert stats["requests_aborted"] > before["requests_aborted"], stats  # aborted, not run to its end
    assert stats["tokens_generated"] - before["tokens_generated"] < 3000, stats


def test_ttl_from_the_environment_and_a_killed_engine(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """MLX_ENGINE_RESPONSES_TTL expires stored responses; a killed engine ends open streams with
    `error` + `response.failed` (sequence numbers still unbroken)."""
    endpoint = f"ipc://{ipc_dir}/responses.sock"
    model = str(tiny_model)
    engine = Engine(endpoint, tmp_path / "engined.log", model=model, env={"MLX_ENGINE_RESPONSES_TTL": "1"})
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=1, args=["--graceful-timeout", "1"])
    client = None
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        client = client_for(frontend)
        stored = client.responses.create(model=model, input="Hi", max_output_tokens=2)
        assert client.responses.retrieve(stored.id).id == stored.id
        time.sleep(1.2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(stored.id)

        events = []
        with client.responses.create(stream=True, model=model, input="Talk for a long time.",
                                     max_output_tokens=3000, extra_body={"ignore_eos": True}) as stream:
            for event in stream:
                events.append(event)
                if len(events) == 6:
                    engine.signal(signal.SIGKILL)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"], [e.type for e in events[-3:]]
        assert events[-2].code in ("engine_unavailable", "engine_restarted")
        assert events[-1].response.status == "failed" and events[-1].response.error.code == events[-2].code
    finally:
        if client is not None:
            client.close()
        frontend.stop()
        engine.stop()


def test_input_items_and_cancel(frontend: Frontend, model_id: str) -> None:
    """GET …/input_items lists the stored input (the SDK's pager reads it); cancel is a clear 400."""
    client = openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.responses.create(model=model_id, input="Name a colour.", max_output_tokens=4, temperature=0)
    items = list(client.responses.input_items.list(first.id))
    assert len(items) == 1 and items[0].type == "message" and items[0].role == "user"
    assert items[0].content[0].type == "input_text" and items[0].content[0].text == "Name a colour."
    second = client.responses.create(model=model_id, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
        {"role": "user", "content": [{"type": "input_text", "text": "Three"}]}])
    texts = [item.content[0].text for item in client.responses.input_items.list(second.id, order="asc")]
    assert texts == ["One", "Two", "Three"]
    page = client.responses.input_items.list(second.id, limit=2)  # newest first by default
    assert [item.content[0].text for item in page.data] == ["Three", "Two"] and page.has_more
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(first.id)
    assert caught.value.body["code"] == "not_background"


def test_codex_style_request_streams(frontend: Frontend, model_id: str) -> None:
    """A request shaped like Codex CLI's (function tools, store false, include, prompt_cache_key, a prior
    reasoning item with encrypted content, a tool call and its output in the input) streams to completion."""
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                             "workdir": {"type": "string"}},
                            "required": ["command"], "additionalProperties": False}}
    body = {
        "model": model_id, "instructions": "You are a coding agent running in a terminal.", "stream": True,
        "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1",
        "tools": [shell], "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "text": {"verbosity": "low"},
        "max_output_tokens": 8, "temperature": 0,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque-blob"},
            {"type": "function_call", "call_id": "call_1", "name": "shell",
             "arguments": "{\"command\": [\"ls\"]}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc"},
        ],
    }
    with httpx.stream("POST", f"{frontend.base_url}/v1/responses", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    types = [event["type"] for event in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["usage"]["input_tokens"] > 0 and final["usage"]["output_tokens"] == 8
