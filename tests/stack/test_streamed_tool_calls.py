"""A tool call's arguments stream while the model writes them, on the engine's wire and on every API.

Before, a call arrived whole when its closing tag was generated: an agent writing a file sent
nothing for minutes, and Claude Code's stream watchdog gave up. The engine now sends the call's
id and name once written, then its arguments as they settle (`tool_call_deltas`), then the whole
call. Counted on the engine's own DELTAS items (one per step, whatever the machine's load); over
HTTP, each API's pieces add up to the call it returns.
"""

from __future__ import annotations

import json

import anthropic
import zmq

from protocol import PROTOCOL_VERSION, MsgType, decode, encode
from tests.helpers import Engine, Frontend, client_for
from tests.stack.test_tools_reasoning import TOOLS

QUESTION = "What is the weather in Paris?"
FORCED = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)


def engine_items(engine: Engine, rid: str) -> list[dict]:
    """The DELTAS items of one forced-call request sent straight to the engine, until its last."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.endpoint)
    items: list[dict] = []
    try:
        sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION, "frontend_id": rid.split(":")[0]}))
        sock.send(encode(MsgType.ADD, {"rid": rid, "messages": [{"role": "user", "content": QUESTION}],
                                       "params": {"max_tokens": 60, "temperature": 0}, **FORCED}))
        while not (items and items[-1].get("finish_reason")):
            assert sock.poll(60_000), items
            kind, body = decode(sock.recv())
            assert kind != MsgType.ERROR, body
            if kind == MsgType.DELTAS:
                items += [item for item in body["items"] if item["rid"] == rid]
    finally:
        sock.close()
    return items


def test_the_engine_streams_a_calls_arguments_before_the_call_is_whole(engine: Engine) -> None:
    items = engine_items(engine, "streamcalls:1")
    closing = next(n for n, item in enumerate(items) if item.get("tool_calls"))
    (call,) = items[closing]["tool_calls"]
    before = [piece for item in items[:closing] for piece in item.get("tool_call_deltas") or ()]
    assert before and (before[0]["id"], before[0]["name"], before[0]["index"]) == (call["id"], "get_weather", 0)
    assert sum(bool(piece["arguments"]) for piece in before) >= 5  # one step after another, not at the end
    sent = "".join(piece["arguments"] for piece in before)
    assert sent.startswith('{"city": "') and call["arguments"].startswith(sent)
    assert json.loads(call["arguments"])["unit"] in ("C", "F")
    assert not any(item.get("tool_call_deltas") for item in items[closing:])
    assert items[-1]["finish_reason"] == "tool_calls" and not "".join(item.get("text", "") for item in items)


def test_every_api_streams_the_call_it_returns(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    chat = dict(model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=60, temperature=0,
                **FORCED)
    (call,) = client.chat.completions.create(**chat).choices[0].message.tool_calls
    pieces = [tc for c in client.chat.completions.create(stream=True, **chat) if c.choices
              for tc in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments

    responses = dict(model=model_id, input=QUESTION, tools=[{"type": "function", **TOOLS[0]["function"]}],
                     tool_choice="required", parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    events = list(client.responses.create(stream=True, **responses))
    (item,) = client.responses.create(**responses).output
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == item.arguments
    assert events[-1].response.output[0].arguments == item.arguments == call.function.arguments

    messages = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0).messages
    kwargs = dict(model=model_id, max_tokens=60, tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"][
        "parameters"]}], tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": QUESTION}])
    returned = messages.create(**kwargs)
    with messages.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    started = [e for e in events if e.type == "content_block_start"]
    assert {e.content_block.type for e in started} == {"tool_use"} and started[0].content_block.input == {}
    assert len(returned.content) == len(streamed.content) == len(started)  # parallel calls: one block each
    for block, returned_block, streamed_block in zip(started, returned.content, streamed.content):
        partial = "".join(e.delta.partial_json for e in events
                          if e.type == "content_block_delta" and e.index == block.index)
        assert json.loads(partial) == returned_block.input == streamed_block.input
    assert returned.stop_reason == streamed.stop_reason == "tool_use"
