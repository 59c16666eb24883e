"""The mlx thread's frames, taken from its inproc outbox and handed to the ROUTER.

One loop for both places that forward them: `EngineServer.serve` (bounded per poll, so inbound
frames are not starved) and `wind_down` (until the outbox is empty, after SIGTERM).
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

OUTBOX_BATCH = 1000  # frames forwarded per poll while serving


def forward_outbox(outbox: zmq.Socket, send: Callable[[bytes, bytes], None], limit: int | None = OUTBOX_BATCH) -> int:
    """Hands `(peer, frame)` pairs from `outbox` to `send` until it is empty or `limit` were sent; how many."""
    sent = 0
    while limit is None or sent < limit:
        try:
            peer, frame = outbox.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        send(peer, frame)
        sent += 1
    return sent
