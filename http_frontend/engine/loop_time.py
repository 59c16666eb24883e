"""Waiting for the engine's answer with a timeout that counts only time this worker could have heard it.

A worker's event loop can be held for a second or more by work outside it that keeps the
GIL: the JSON parser thread turning a 16 MB body of small arrays into objects
(`parse_json_object`). A plain `asyncio.wait_for` fires as soon as the loop comes back,
before the reader task has taken the answer that arrived meanwhile from the socket, and the
engine gets blamed (a `/health` 503, a CALL's 503) for the worker's own stall. Here the
wait is cut into short ticks; the part of a tick past its length is time the loop was
held, and is not charged to the engine.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")

TICK_SECONDS = 0.1


async def wait_free_time(future: asyncio.Future[T], timeout: float, tick: float = TICK_SECONDS) -> T:
    """`future`'s result, or TimeoutError once `timeout` seconds of free loop time passed without it.

    The future is not cancelled on timeout (unlike `wait_for`): the caller owns it.
    """
    left = timeout
    while True:
        step = min(tick, left)
        done, _ = await asyncio.wait({future}, timeout=step)
        if done:
            return future.result()
        # A tick that ended late ended late because the loop was held: only the tick itself counts.
        left -= step
        if left <= 1e-9:
            raise asyncio.TimeoutError
