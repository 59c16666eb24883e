"""A step's events become frames without ever raising in the mlx thread (`encode_events`)."""

from __future__ import annotations

from engine_daemon.output.parser import parse_json_tool_calls
from engine_daemon.scheduling.frames import encode_events
from protocol import MsgType, decode


def test_an_unencodable_item_ends_only_its_request() -> None:
    good = {"rid": "fe:good", "seq": 1, "text": "hello"}
    bad = {"rid": "fe:bad", "seq": 1, "text": "", "tool_calls": [{"id": 10**30, "name": "f", "arguments": "{}"}]}
    other_peer = {"rid": "fe2:ok", "seq": 1, "text": "x"}
    frames, failed = encode_events([(b"a", MsgType.DELTAS, good), (b"a", MsgType.DELTAS, bad),
                                    (b"b", MsgType.DELTAS, other_peer)])
    assert failed == {"fe:bad"}
    decoded = [(peer, *decode(frame)) for peer, frame in frames]
    assert (b"a", MsgType.DELTAS, {"items": [good]}) in decoded
    assert (b"b", MsgType.DELTAS, {"items": [other_peer]}) in decoded
    errors = [body for peer, kind, body in decoded if kind == MsgType.ERROR]
    assert errors == [{"rid": "fe:bad", "status": 500, "code": "unencodable_output", "type": "server_error",
                       "message": "The engine produced output it could not send; the request was ended"}]


def test_an_unencodable_reply_still_answers_its_caller() -> None:
    frames, failed = encode_events([(b"a", MsgType.RESULT, {"cid": "c1", "result": {"n": 2**70}})])
    assert failed == set()
    [(peer, frame)] = frames
    kind, body = decode(frame)
    assert peer == b"a" and kind == MsgType.ERROR and body["cid"] == "c1" and body["code"] == "unencodable_output"


def test_tool_call_ids_are_always_minted_by_the_engine() -> None:
    [call] = parse_json_tool_calls('{"name": "f", "arguments": {}, "id": 1000000000000000000000000000000}')
    assert "id" not in call  # OutputParser mints "call_<24 hex>" for every call it emits
