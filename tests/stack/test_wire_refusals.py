"""Malformed ADDs on the engine socket are refused with 400 naming the field, never a 500 (red team E1)."""

from __future__ import annotations

import time

import zmq

from protocol import PROTOCOL_VERSION, MsgType, decode, encode
from tests.helpers import Engine

MESSAGES = [{"role": "user", "content": "hi"}]

# rid -> (ADD fields over a good one, the field the refusal must name)
MALFORMED = {
    "min-tokens-str": ({"params": {"max_tokens": 3, "min_tokens": "5"}}, "min_tokens"),
    "min-tokens-list": ({"params": {"max_tokens": 3, "min_tokens": [1]}}, "min_tokens"),
    "min-tokens-float": ({"params": {"max_tokens": 3, "min_tokens": 2.5}}, "min_tokens"),
    "budget-neg": ({"params": {"max_tokens": 3, "thinking_budget": -5}}, "thinking_budget"),
    "tools-ints": ({"tools": [1, 2, 3]}, "tools"),
    "tools-fn-str": ({"tools": [{"type": "function", "function": "f"}]}, "tools"),
    "tools-name-list": ({"tools": [{"type": "function", "function": {"name": ["f"]}}]}, "tools"),
    "call-fn-none": ({"messages": [{"role": "assistant", "tool_calls": [{"function": None}]},
                                   {"role": "user", "content": "x"}]}, "messages"),
    "calls-int": ({"messages": [{"role": "assistant", "tool_calls": 5}, *MESSAGES]}, "messages"),
    "role-int": ({"messages": [{"role": 5, "content": "x"}]}, "messages"),
    "parts-int": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, 5]}]}, "messages"),
}


def test_malformed_adds_get_400_naming_the_field(engine: Engine) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.endpoint)
    try:
        sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION, "frontend_id": "malformed"}))
        for rid, (fields, _) in MALFORMED.items():
            sock.send(encode(MsgType.ADD, {"rid": rid, "messages": MESSAGES, "params": {"max_tokens": 3}, **fields}))
        answers: dict[str, dict] = {}
        deadline = time.monotonic() + 30
        while len(answers) < len(MALFORMED) and time.monotonic() < deadline:
            if sock.poll(500):
                msg_type, body = decode(sock.recv())
                if msg_type in (MsgType.ERROR, MsgType.ACCEPTED) and body.get("rid") in MALFORMED:
                    answers[body["rid"]] = {**body, "frame": msg_type.name}
        for rid, (_, param) in MALFORMED.items():
            answer = answers.get(rid)
            assert answer is not None, f"{rid}: no answer"
            assert answer["frame"] == "ERROR" and answer["status"] == 400, (rid, answer)
            assert answer.get("param") == param and param in answer["message"], (rid, answer)
    finally:
        sock.close(0)


def test_garbage_and_huge_ids_do_not_flood_the_log(engine: Engine) -> None:
    """Red team E9/E1: one warning per garbage frame (87 MB of log in 20 s), and a 1 MB request id in every
    line of its request. Now: a peer's bad frames are logged once per BAD_FRAME_QUIET, long ids refused."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.endpoint)
    before = len(engine.log())
    try:
        sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION, "frontend_id": "f" * 100_000}))
        sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION, "frontend_id": "flood"}))
        for _ in range(5000):
            sock.send(b"\x03\xc1" * 10)
        huge = "r" * 1_000_000
        sock.send(encode(MsgType.ADD, {"rid": huge, "messages": MESSAGES, "params": {"max_tokens": 3}}))
        answer = None
        deadline = time.monotonic() + 30
        while answer is None and time.monotonic() < deadline:
            if sock.poll(500):
                msg_type, body = decode(sock.recv())
                if msg_type == MsgType.ERROR and body.get("rid") == huge:
                    answer = body
        assert answer is not None and answer["status"] == 400 and answer["param"] == "rid", answer
        time.sleep(0.5)
        grown = engine.log()[before:]
        assert len(grown) < 20_000, f"{len(grown)} bytes of log: {grown[:500]}"
        assert grown.count("bad frame from") <= 2, grown[:2000]
    finally:
        sock.close(0)
