"""`n` > 1 streams merged into one body: indexes, one [DONE], and back-pressure on a client that stops reading."""

from __future__ import annotations

import asyncio
import itertools

from falcon.asgi import SSEvent

from http_frontend.relay.choices import MERGE_QUEUE_PER_CHOICE, merge_event_streams


class Source:
    """One choice's SSE body: `count` content chunks (None: without end), then [DONE]; counts what was pulled."""

    def __init__(self, count: int | None) -> None:
        self.count, self.pulled, self.closed = count, 0, False

    async def body(self):
        try:
            for _ in itertools.count() if self.count is None else range(self.count):
                self.pulled += 1
                yield SSEvent(json={"choices": [{"index": 0, "delta": {"content": "x"}}]})
            yield SSEvent(data=b"[DONE]")
        finally:
            self.closed = True


def test_choices_are_interleaved_with_their_indexes_and_one_done() -> None:
    async def run() -> list[SSEvent]:
        sources = [Source(3), Source(5)]
        return [event async for event in merge_event_streams([s.body() for s in sources], include_usage=False)]

    events = asyncio.run(run())
    indexes = sorted(event.json["choices"][0]["index"] for event in events if event.json)
    assert indexes == [0, 0, 0, 1, 1, 1, 1, 1]
    assert [event.data for event in events if not event.json] == [b"[DONE]"]


def test_a_client_that_stops_reading_stops_the_choices() -> None:
    """The merged body's queue is bounded: unread output stays in the choices (where the slow-client cap sees it)."""

    async def run() -> list[Source]:
        sources = [Source(None) for _ in range(3)]
        merged = merge_event_streams([s.body() for s in sources], include_usage=False)
        await merged.__anext__()  # the client reads one event, then nothing
        for _ in range(200):
            await asyncio.sleep(0)
        pulled = [s.pulled for s in sources]
        await merged.aclose()  # the client leaves: every choice's body is closed, no pump left running
        assert all(s.closed for s in sources)
        return pulled

    pulled = asyncio.run(run())
    assert sum(pulled) <= MERGE_QUEUE_PER_CHOICE * 3 + 3 + 1, pulled
