"""Failed handshakes with the engine, said: otherwise a wrong key or version looks exactly like a dead engine.

An engine that speaks another protocol version refuses the HELLO with an ERROR
(`protocol_version_mismatch`) and then ignores the front-end: `version_refusal` is what the
front-end says instead of "not reachable" (in /health, the 503s and its log).

A front-end whose key is not on the engine's allow-list, or that has the wrong server key, or
that speaks plain ZeroMQ to a CURVE engine, gets no answer and its clients get 503
`engine_unavailable`; ZeroMQ reports why only on a socket monitor. This reads the DEALER's
monitor and logs each kind of failure at most once per `QUIET_SECONDS` (a reconnect retries every
second), with how many were folded into the line.
"""

from __future__ import annotations

import logging
import re
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol import PROTOCOL_VERSION

log = logging.getLogger(__name__)

QUIET_SECONDS = 30.0
FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed: does the engine run CURVE, with the key of --curve-server-key?",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed: the engine speaks another security mechanism or key (protocol "
                                         "error; check --curve-server-key, and that the engine runs CURVE)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "was refused: this front-end's key is not in the engine's "
                                     "--curve-authorized-keys",
}

VERSION_MISMATCH = "protocol_version_mismatch"  # the ERROR code of an engine refusing a HELLO


def version_refusal(engine_id: str, message: str) -> str:
    """What to say of engine `engine_id` that refused this front-end's protocol version (its ERROR's `message`).

    No endpoint: clients read it in their 503s (the log line names the endpoint).
    """
    found = re.search(r"engine speaks protocol (\d+)", message or "")
    engine = found.group(1) if found else "another"
    who = "The engine" if engine_id == "engine" else f"Engine '{engine_id}'"
    return (f"{who} speaks protocol version {engine}, this front-end {PROTOCOL_VERSION}: upgrade one of them "
            "(engine and front-end must come from the same mlx-engined release)")


def handshake_monitor(sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    """The monitor of `sock`'s failed handshakes; made before `sock` connects: a refusal may come within
    milliseconds of the connect, and ZeroMQ may not retry after it (a monitor made later saw nothing)."""
    events = 0
    for event in FAILURES:
        events |= event
    return sock.get_monitor_socket(events)


async def watch_handshakes(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, endpoint: str) -> None:
    """Runs until cancelled; logs failed handshakes of `sock` (seen by `monitor`) with the engine at `endpoint`."""
    last: dict[int, float] = {}
    folded: dict[int, int] = {}
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event not in FAILURES:
                continue
            now = time.monotonic()
            if now - last.get(event, -QUIET_SECONDS) < QUIET_SECONDS:
                folded[event] = folded.get(event, 0) + 1
                continue
            more = folded.pop(event, 0)
            last[event] = now
            log.warning("CURVE handshake with the engine at %s %s%s", endpoint, FAILURES[event],
                        f" ({more} more since the last line)" if more else "")
    finally:
        sock.disable_monitor()
        monitor.close(0)
