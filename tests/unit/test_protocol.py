"""The wire contract: round trips, and malformed frames refused with a reason."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import CallMethod, MsgType, ProtocolError, decode, encode, new_request_id, request_id_owner
from protocol.messages import MAX_FRAME_BYTES, MAX_ID_CHARS


def add_body(**overrides):
    body = {"rid": "fe:1", "messages": [{"role": "user", "content": "hi"}], "params": {"max_tokens": 4}}
    body.update(overrides)
    return body


def test_round_trip_every_type_byte() -> None:
    msg_type, body = decode(encode(MsgType.ADD, add_body()))
    assert msg_type == MsgType.ADD and body == add_body()
    assert decode(encode(MsgType.PING, {}))[0] == MsgType.PING
    deltas = {"items": [{"rid": "a:b", "seq": 0, "text": "x"}]}
    assert decode(encode(MsgType.DELTAS, deltas))[1]["items"][0]["text"] == "x"


@pytest.mark.parametrize("frame, fragment", [
    (b"", "empty"),
    (b"\xff\x80", "unknown message type"),
    (bytes([MsgType.PING]) + b"\xc1", "undecodable"),
    (bytes([MsgType.PING]) + msgpack.packb([1, 2]), "must be a map"),
    (encode(MsgType.HELLO, {"frontend_id": "x"}), "missing field 'version'"),
    (encode(MsgType.HELLO, {"version": "1", "frontend_id": "x"}), "wrong type"),
    (encode(MsgType.ADD, add_body(params={"max_tokens": True})), "max_tokens"),
    (encode(MsgType.ADD, add_body(params={"stop": [1]})), "stop"),
    (encode(MsgType.ADD, add_body(messages=None)), "needs 'messages' or 'prompt'"),
    (encode(MsgType.ADD, add_body(messages=["x"])), "map"),
    (encode(MsgType.ABORT, {"rids": [1]}), "strings"),
    (encode(MsgType.DELTAS, {"items": [{"seq": 1}]}), "rid"),
    (encode(MsgType.ADD, add_body(params={"min_tokens": "5"})), "param 'min_tokens'"),
    (encode(MsgType.ADD, add_body(tools=[1, 2, 3])), "tools[0] must be a map"),
    (encode(MsgType.ADD, add_body(tools=[{"type": "function", "function": "f"}])), "tools[0].function"),
    (encode(MsgType.ADD, add_body(tools=[{"function": {"name": 5}}])), "tools[0].function.name"),
    (encode(MsgType.ADD, add_body(messages=[{"role": 5, "content": "x"}])), "messages[0].role"),
    (encode(MsgType.ADD, add_body(messages=[{"role": "user", "content": 5}])), "messages[0].content"),
    (encode(MsgType.ADD, add_body(messages=[{"role": "user", "content": ["x", 5]}])), "parts"),
    (encode(MsgType.ADD, add_body(messages=[{"role": "assistant", "tool_calls": 5}])), "tool_calls must be a list"),
    (encode(MsgType.ADD, add_body(messages=[{"role": "assistant", "tool_calls": [{"function": "f"}]}])),
     "messages[0].tool_calls[0].function"),
])
def test_malformed_frames_are_refused(frame: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert fragment in str(info.value)


def test_refusal_names_the_request_so_it_can_be_answered() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(encode(MsgType.ADD, add_body(params={"temperature": "hot"})))
    assert info.value.rid == "fe:1"


def test_refusal_names_the_param() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(encode(MsgType.ADD, add_body(params={"min_tokens": [1]})))
    assert info.value.param == "min_tokens"
    with pytest.raises(ProtocolError) as info:
        decode(encode(MsgType.ADD, add_body(tools=[1])))
    assert info.value.param == "tools"


def test_every_ranged_param_has_a_wire_type() -> None:
    """A param the engine range-checks but the wire lets through untyped reached `check_params` as a string: 500."""
    from engine_daemon.request.param_checks import PARAM_RANGES
    from protocol.messages import PARAM_TYPES

    assert set(PARAM_RANGES) <= set(PARAM_TYPES)


def test_oversized_frame_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(bytes([MsgType.PING]) + b"\0" * MAX_FRAME_BYTES)


def test_request_ids_carry_their_owner() -> None:
    rid = new_request_id("host-12-ab")
    assert request_id_owner(rid) == "host-12-ab"
    assert rid != new_request_id("host-12-ab")
    assert request_id_owner("nocolon") == ""


def test_overlong_ids_are_refused_with_the_field() -> None:
    assert decode(encode(MsgType.ADD, add_body(rid="r" * MAX_ID_CHARS)))[1]["rid"] == "r" * MAX_ID_CHARS
    with pytest.raises(ProtocolError) as info:
        decode(encode(MsgType.ADD, add_body(rid="r" * (MAX_ID_CHARS + 1))))
    assert info.value.param == "rid" and info.value.rid == "r" * (MAX_ID_CHARS + 1)
    with pytest.raises(ProtocolError, match="frontend_id"):
        decode(encode(MsgType.HELLO, {"version": 1, "frontend_id": "f" * 10_000}))
    with pytest.raises(ProtocolError, match="cid"):
        decode(encode(MsgType.CALL, {"cid": "c" * 10_000, "method": "stats"}))


WIRE_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1) | st.floats() | st.text()
    | st.binary(),
    lambda children: st.lists(children, max_size=6) | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 300), children, max_size=6),
    max_leaves=60,
)


@settings(max_examples=500, deadline=None)
@given(WIRE_VALUES)
def test_frames_are_the_bytes_msgpack_would_pack(value: object) -> None:
    """`encode` packs with msgspec (faster, the GIL held less): a peer of an earlier release reads the same bytes."""
    assert encode(MsgType.DELTAS, {"v": value}) == bytes((int(MsgType.DELTAS),)) + msgpack.packb({"v": value},
                                                                                                use_bin_type=True)


@pytest.mark.parametrize("size", [0, 31, 32, 255, 256, 65535, 65536])
def test_frames_match_msgpack_at_every_length_boundary(size: int) -> None:
    for value in ("a" * size, b"a" * size, [1] * size, {str(i): i for i in range(size)}):
        assert encode(MsgType.DELTAS, {"v": value})[1:] == msgpack.packb({"v": value}, use_bin_type=True)


@pytest.mark.parametrize("value", [2**64, -2**63 - 1, "a\ud800"])
def test_encode_refuses_what_msgpack_refuses(value: object) -> None:
    with pytest.raises((OverflowError, UnicodeEncodeError)):
        encode(MsgType.DELTAS, {"v": value})


def test_call_methods_travel_as_their_plain_names() -> None:
    frame = encode(MsgType.CALL, {"cid": "c1", "method": CallMethod.STATS})
    assert frame[1:] == msgpack.packb({"cid": "c1", "method": "stats"}, use_bin_type=True)


def test_subclasses_of_builtin_scalars_pack_as_msgpack_packs_them() -> None:
    """msgspec refuses a float subclass (NumPy's float64, which an engine's arithmetic can hand over) where msgpack
    packs it as a float: frames would have failed where they used to go out."""
    import numpy as np

    class Name(str):
        pass

    class Count(int):
        pass

    body = {"f": np.float64(1.5), "s": Name("x"), "i": Count(3), "b": bytearray(b"ab"), "t": (1, 2)}
    assert encode(MsgType.DELTAS, body)[1:] == msgpack.packb(body, use_bin_type=True)
    for value in (np.float32(1.5), np.int64(3), object()):  # what msgpack refuses is still refused
        with pytest.raises(TypeError):
            encode(MsgType.DELTAS, {"v": value})
