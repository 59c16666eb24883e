"""A slow reader's pending deltas merge into one update (the stream collector), without processes."""

from __future__ import annotations

import asyncio

from http_frontend.engine.client import RequestStream


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
