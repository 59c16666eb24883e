"""Token prompts packed for the engine (`protocol.token_ids`): the format, the frame check, and who packs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from http_frontend.engine.client import EngineClient
from protocol import MsgType, ProtocolError, decode, encode
from protocol.messages import MAX_FRAME_BYTES
from protocol.token_ids import FEATURE, pack_token_ids, packed_count, unpack_token_ids


def test_ids_round_trip_as_little_endian_uint32() -> None:
    ids = [0, 1, 127, 128, 65_535, 151_935, 2**32 - 1]
    packed = pack_token_ids(ids)
    assert packed is not None and len(packed) == 4 * len(ids) and packed_count(packed) == len(ids)
    assert packed[4:8] == b"\x01\x00\x00\x00"  # little-endian whatever the machine
    assert unpack_token_ids(packed) == ids


@pytest.mark.parametrize("ids", [[-1, 2], [2**32], [1, "x"], [1.5]])
def test_ids_outside_uint32_are_not_packed(ids: list) -> None:
    assert pack_token_ids(ids) is None  # sent as a list: the engine names the problem as it always did


def test_a_packed_prompt_of_torn_ids_is_refused_at_the_boundary() -> None:
    body = {"rid": "r", "params": {}, "prompt": pack_token_ids([1, 2, 3])}
    assert decode(encode(MsgType.ADD, body))[1]["prompt"] == body["prompt"]
    with pytest.raises(ProtocolError, match="whole 4-byte token ids"):
        decode(encode(MsgType.ADD, {**body, "prompt": b"\x01\x02\x03\x04\x05"}))
    with pytest.raises(ValueError):
        unpack_token_ids(b"\x01\x02")


def _link(*features: str) -> SimpleNamespace:
    return SimpleNamespace(features=frozenset(features))


def test_the_front_end_packs_only_for_an_engine_that_reads_it() -> None:
    request = {"model": "m", "prompt": [3, 4, 5], "params": {}}
    assert EngineClient._packed(_link(), request) is request  # an older engine: ids as a list
    packed = EngineClient._packed(_link(FEATURE), request)
    assert packed["prompt"] == pack_token_ids([3, 4, 5]) and request["prompt"] == [3, 4, 5]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "params": {}}
    assert EngineClient._packed(_link(FEATURE), chat) is chat
    text = {"model": "m", "prompt": "hi", "params": {}}
    assert EngineClient._packed(_link(FEATURE), text) is text


def test_ids_that_do_not_pack_or_would_fill_a_frame_go_as_a_list() -> None:
    negative = {"prompt": [1, -2], "params": {}}
    assert EngineClient._packed(_link(FEATURE), negative) is negative
    huge = {"prompt": [1] * (MAX_FRAME_BYTES // 8 + 1), "params": {}}  # 1 byte each in msgpack, 4 packed
    assert EngineClient._packed(_link(FEATURE), huge) is huge
