"""Token-id prompts are checked in C (`is_token_ids`, `parse_prompts`): the answers of the Python walk they replace."""

from __future__ import annotations

from typing import Any

import pytest

from http_frontend.errors import APIError
from http_frontend.openai.completions import parse_prompts
from http_frontend.openai.tokenize import is_token_ids


def walked(value: Any) -> bool:
    """The check as it was: every element an int, not a bool, within 64 bits."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and -2**63 <= t < 2**63
                                           for t in value)


@pytest.mark.parametrize("value", [
    [], [0], [1, 2, 3], [-2**63, 2**63 - 1], [1, True], [False], [1, 2**63], [1, -2**63 - 1], [1, 2**64],
    [1, 1.0], [1, "2"], [1, None], [[1]], "123", None, {"a": 1}, (1, 2),
])
def test_is_token_ids_agrees_with_the_walk(value: Any) -> None:
    assert is_token_ids(value) == walked(value)


@pytest.mark.parametrize("prompt,message", [
    ([1, True], "expected a string or an array of token ids"),
    ([[1, 2.5]], "expected a string or an array of token ids"),
    ([3, -1], "token ids cannot be negative"), ([[0, -5]], "token ids cannot be negative"),
    ([], "must not be empty"),
])
def test_bad_token_prompts_are_refused(prompt: Any, message: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_prompts({"prompt": prompt})
    assert caught.value.status == 400 and message in caught.value.message and caught.value.param == "prompt"


def test_token_prompts_pass_unchanged() -> None:
    ids = list(range(100_000))
    assert parse_prompts({"prompt": ids})[0] is ids
    assert parse_prompts({"prompt": [[5, 6]]}) == [[5, 6]]
    assert parse_prompts({"prompt": [[5, 6], [7]]}) == [[5, 6], [7]]
