"""A slow reader's pending deltas merge into as few updates as keep the model's order (the stream collector)."""

from __future__ import annotations

import asyncio

from http_frontend.anthropic.stream import BlockBuilder
from http_frontend.engine.client import RequestStream
from http_frontend.openai.responses_stream import ResponseBuilder


def test_pending_deltas_merge_into_one_update() -> None:
    async def run() -> None:
        stream = RequestStream("fe:1")
        for i in range(1000):
            stream.on_deltas({"rid": "fe:1", "seq": i, "text": "ab", "token_ids": [i]})
        stream.on_deltas({"rid": "fe:1", "seq": 1000, "text": "!", "finish_reason": "length",
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1000, "total_tokens": 1001}})
        update = await stream.next_update(0.1)
        assert update.text == "ab" * 1000 + "!" and len(update.token_ids) == 1000
        assert update.finish_reason == "length"
        assert await stream.next_update(0.05) is None  # nothing queued behind it

    asyncio.run(run())


def _call(index: int, arguments: str) -> dict:
    return {"index": index, "id": f"call_{index}", "name": "f", "arguments": arguments}


# An agent's turn as the engine sends it, one DELTAS item each: think, call, think, call, answer.
_INTERLEAVED = [
    {"reasoning": "look first"},
    {"tool_call_deltas": [{"index": 0, "id": "call_0", "name": "f", "arguments": '{"a": '}]},
    {"tool_calls": [_call(0, '{"a": 1}')]},
    {"reasoning": "then the other"},
    {"tool_call_deltas": [{"index": 1, "id": "call_1", "name": "f", "arguments": '{"a": 2}'}]},
    {"tool_calls": [_call(1, '{"a": 2}')]},
    {"text": "done"},
]


async def _unread_then_drained(items: list[dict]) -> list:
    """Every item arrives before the reader looks once (a slow client): what it then reads, in order."""
    stream = RequestStream("fe:1")
    for seq, item in enumerate(items):
        stream.on_deltas({"rid": "fe:1", "seq": seq, **item})
    stream.on_deltas({"rid": "fe:1", "seq": len(items), "finish_reason": "tool_calls",
                      "usage": {"prompt_tokens": 1, "completion_tokens": 9, "total_tokens": 10}})
    updates = []
    while (update := await stream.next_update(0.05)) is not None:
        updates.append(update)
    assert stream.pending_bytes == 0
    return updates


def test_a_slow_reader_gets_thinking_calls_and_text_in_the_models_order() -> None:
    updates = asyncio.run(_unread_then_drained(_INTERLEAVED))
    builder = BlockBuilder()
    for update in updates:
        builder.feed(update)
    builder.finish()
    assert [(block["type"], block.get("thinking") or block.get("input") or block.get("text"))
            for block in builder.blocks] == [("thinking", "look first"), ("tool_use", {"a": 1}),
                                             ("thinking", "then the other"), ("tool_use", {"a": 2}),
                                             ("text", "done")]
    responses = ResponseBuilder({"id": "resp_1", "object": "response", "created_at": 1, "model": "m"})
    for update in updates:
        responses.feed(update)
    assert [item["type"] for item in responses.response()["output"]] == [
        "reasoning", "function_call", "reasoning", "function_call", "message"]
    assert len(updates) < len(_INTERLEAVED)  # merged where the order allows


def test_text_before_a_call_still_merges_with_it() -> None:
    updates = asyncio.run(_unread_then_drained([{"text": "Let me look."}, {"text": "\n"},
                                                {"tool_calls": [_call(0, "{}")]}]))
    assert len(updates) == 1 and updates[0].text == "Let me look.\n" and updates[0].finish_reason


def test_updates_kept_apart_count_against_the_slow_client_cap() -> None:
    """Output alternating one character of text and a one-character call piece: each switch keeps an update of
    its own; they must reach the cap long before their memory (~740 bytes each) is hundreds of times it."""
    stream = RequestStream("fe:1", max_pending_bytes=50_000)
    seq = 0
    while not stream.over_limit and seq < 40_000:
        stream.on_deltas({"rid": "fe:1", "seq": seq, "text": "a"})
        stream.on_deltas({"rid": "fe:1", "seq": seq + 1, "tool_call_deltas": [{"index": seq, "arguments": "{"}]})
        seq += 2
    assert stream.over_limit and seq < 400


def test_a_drained_stream_counts_nothing() -> None:
    updates = asyncio.run(_unread_then_drained(_INTERLEAVED * 3))
    assert updates[-1].finish_reason == "tool_calls"
