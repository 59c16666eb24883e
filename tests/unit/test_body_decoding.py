"""The front-end's fast body parser (`decoded`, msgspec) gives what `json.loads` always gave.

msgspec parses arrays of numbers ~5x faster than `json.loads`, and both hold the GIL for the whole
body: a 13 MB token-id prompt paused every stream of its worker 0.66 s in `json.loads`. Whatever
msgspec refuses goes through `json.loads`, so values and error messages stay as they were.
"""

from __future__ import annotations

import json
import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from http_frontend.errors import APIError
from http_frontend.parsing import body as body_module
from http_frontend.parsing.body import check_encodable, decoded, parse_json_object

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
    | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, st.booleans())
def test_decoded_equals_json_loads(value: object, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert decoded(raw) == json.loads(raw)


@pytest.mark.parametrize("raw", [
    b'{"a": 1, "a": 2}', b'{"x": 123456789012345678901234567890}', b'{"x": -0.0, "y": 1e-320, "z": 0.1}',
    b'{"x": NaN}', b'{"x": Infinity}', b'{"x": 1e400}', b'\xef\xbb\xbf{"a": 1}', '{"a": "é"}'.encode("utf-16"),
    b'{"a": "\\ud800"}', b'{"a": "\xed\xa0\x80"}', b'{"a": "\\u00e9\\ud83d\\ude00"}', b' {"a": [] } \n',
])
def test_edge_cases_keep_json_loads_answer(raw: bytes) -> None:
    expected = json.loads(raw)
    got = decoded(raw)
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)
    if isinstance(expected.get("x"), float) and math.isnan(expected["x"]):
        assert math.isnan(got["x"])


@pytest.mark.parametrize("raw", [b'{"a": [1, 2', b'{"a": 01}', b"{'a': 1}", b'{"a": 1} x',
                                 b'{"a": ' + b"[" * 100_000])
def test_malformed_bodies_get_json_loads_message(raw: bytes) -> None:
    try:
        json.loads(raw)
    except RecursionError:  # refused for its depth, named where (`json_limits`)
        expected = ("Invalid 'a.[0].[0].[0].[0].[0].[0].[0].…(246 more levels)….[0].[0]': the request body nests "
                    "arrays and objects more than 256 levels deep there; at most 256 levels are allowed")
    except ValueError as exc:
        expected = f"The request body is not valid JSON: {exc}"
    with pytest.raises(APIError) as caught:
        parse_json_object(raw)
    assert (caught.value.status, caught.value.code, caught.value.message) == (400, "invalid_json", expected)


def test_valid_bodies_never_reach_json_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is the one taken: a token-id prompt is parsed and checked without `json.loads`/`packb`."""
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("slow path taken")

    monkeypatch.setattr(body_module.json, "loads", refuse)
    monkeypatch.setattr(msgpack, "packb", refuse)
    raw = json.dumps({"model": "m", "prompt": list(range(200_000))}).encode()
    assert parse_json_object(raw)["prompt"][-1] == 199_999


def test_deep_bodies_are_refused_by_either_parser() -> None:
    """msgspec's packer has no nesting limit (msgpack's is 1,024 levels): both parsers stop first, at Python's,
    and a body the parsers take is held to `MAX_NESTING` (the chat template failed from ~500 levels)."""
    raw = b'{"a": ' + b"[" * 255 + b"]" * 255 + b"}"
    assert parse_json_object(raw)["a"] == json.loads(raw)["a"]
    for depth in (256, 600, 900, 1100, 100_000):
        with pytest.raises(APIError) as caught:
            parse_json_object(b'{"a": ' + b"[" * depth + b"]" * depth + b"}")
        assert (caught.value.status, caught.value.code) == (400, "invalid_json")
        assert caught.value.param == "a.[0].[0].[0].[0].[0].[0].[0].…(246 more levels)….[0].[0]"
        assert "more than 256 levels deep" in caught.value.message


@pytest.mark.parametrize("value", [2**64, -2**63 - 1, "a\ud800"])
def test_fast_check_refuses_what_msgpack_refuses(value: object) -> None:
    with pytest.raises(APIError) as caught:
        check_encodable({"f": value})
    assert (caught.value.code, caught.value.param) == ("invalid_value", "f")
