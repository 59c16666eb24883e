"""An engine of another protocol version refuses the front-end's HELLO: /health and the 503s say so.

Red team: /health and every request said "The engine is not reachable"; the real cause (the engine's
ERROR `protocol_version_mismatch`) was one front-end log line. A stand-in engine (a ROUTER socket)
answers as an engine of version PROTOCOL_VERSION + 1 does: PINGs until the HELLO, that refused, then
nothing from this front-end is heard.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import zmq
from falcon import testing

from http_frontend.app import create_app
from http_frontend.engine.client import EngineClient
from http_frontend.settings import FrontendSettings
from protocol import PROTOCOL_VERSION, MsgType, decode, encode

OTHER = PROTOCOL_VERSION + 1
TRIES = 400  # polls of 25 ms for the client to read the engine's answers


class OtherVersionEngine(threading.Thread):
    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.bound, self.stopped, self.refused = threading.Event(), threading.Event(), threading.Event()

    def run(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self.bound.set()
        refused: set[bytes] = set()
        try:
            while not self.stopped.is_set():
                if not sock.poll(20):
                    continue
                peer, frame = sock.recv_multipart()
                msg_type, body = decode(frame)
                if peer in refused:
                    continue
                if msg_type == MsgType.HELLO:
                    refused.add(peer)
                    sock.send_multipart([peer, encode(MsgType.ERROR, {
                        "status": 400, "code": "protocol_version_mismatch", "type": "invalid_request_error",
                        "message": f"engine speaks protocol {OTHER}, front-end {body['version']}"})])
                    self.refused.set()
                elif msg_type == MsgType.PING:
                    sock.send_multipart([peer, encode(MsgType.PONG, {"epoch": 7, "state": "ready", "model": "m",
                                                                     "queued": 0, "running": 0})])
        finally:
            sock.close(0)
            context.term()


def test_health_and_requests_say_the_engine_speaks_another_protocol_version(tmp_path: Path) -> None:
    engine = OtherVersionEngine(f"ipc://{tmp_path}/engine.sock")
    engine.start()
    engine.bound.wait(10)
    said = f"speaks protocol version {OTHER}, this front-end {PROTOCOL_VERSION}: upgrade one of them"

    async def ask() -> tuple:
        client = EngineClient(engine.endpoint)
        app = create_app(settings=FrontendSettings(), engine=client)
        async with testing.ASGIConductor(app) as conductor:
            for _ in range(TRIES):  # until the client took the engine for down (the refusal, or its silence)
                if engine.refused.is_set() and client.engine_state == "unreachable":
                    break
                await asyncio.sleep(0.025)
            health = await conductor.simulate_get("/health")
            chat = await conductor.simulate_post("/v1/chat/completions", json={
                "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            messages = await conductor.simulate_post("/v1/messages", json={
                "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        return health, chat, messages

    try:
        health, chat, messages = asyncio.run(ask())
    finally:
        engine.stopped.set()
        engine.join(10)
    assert engine.refused.is_set()
    assert health.status_code == 503 and said in health.json["error"], health.json
    assert chat.status_code == 503 and chat.headers.get("retry-after") == "1"
    assert chat.json["error"]["code"] == "engine_unavailable" and said in chat.json["error"]["message"], chat.json
    assert messages.status_code == 503 and said in messages.json["error"]["message"], messages.json
