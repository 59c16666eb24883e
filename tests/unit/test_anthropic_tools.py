"""Anthropic tools whose `type` is not a string, and a `tool_choice.type` that is not: 400s, not 500s.

The OpenAPI fuzz (tests/stack/test_openapi.py) sent `/v1/messages/count_tokens` a tool whose `type` was a
list: `tool.get("type") in CLIENT_TOOLS` raised "unhashable type" and the route answered 500.
"""

from __future__ import annotations

from typing import Any

import pytest

from http_frontend.anthropic.tools import parse_anthropic_tool_choice, parse_anthropic_tools
from http_frontend.errors import APIError


@pytest.mark.parametrize("kind", [["bash_20250124"], {"a": 1}, 3])
def test_a_tool_type_that_is_not_a_string_is_a_400_naming_it(kind: Any) -> None:
    with pytest.raises(APIError) as caught:
        parse_anthropic_tools({"tools": [{"name": "f", "input_schema": {"type": "object"}, "type": kind}]})
    assert (caught.value.status, caught.value.param) == (400, "tools.0.type")


@pytest.mark.parametrize("kind", [["auto"], {"a": 1}])
def test_a_tool_choice_type_that_is_not_a_string_is_a_400(kind: Any) -> None:
    with pytest.raises(APIError) as caught:
        parse_anthropic_tool_choice({"tool_choice": {"type": kind}}, None)
    assert caught.value.status == 400
