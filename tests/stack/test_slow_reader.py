"""A slow reader costs bounded memory (merged deltas) and never slows other clients."""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.helpers import Frontend


def test_a_stalled_reader_does_not_slow_others(frontend: Frontend, model_id: str) -> None:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}

    def timed() -> float:
        started = time.monotonic()
        r = httpx.post(f"{frontend.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200
        return time.monotonic() - started

    baseline = min(timed() for _ in range(3))
    # A client that asks for a long stream and then does not read it at all.
    stalled = socket.create_connection(("127.0.0.1", frontend.port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    payload = json.dumps({**body, "max_tokens": 3000, "stream": True}).encode()
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    try:
        time.sleep(0.5)
        during = [timed() for _ in range(3)]
        # Others share the batch with the stalled stream, so allow for one more row per step.
        assert max(during) < baseline * 3 + 0.5, (baseline, during)
        stalled.settimeout(10)
        assert stalled.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        stalled.close()
