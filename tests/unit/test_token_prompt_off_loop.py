"""A long token prompt is checked off the front-end's event loop (7 M ids walked there held every stream)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from http_frontend.errors import APIError
from http_frontend.openai import completions
from http_frontend.openai.completions import OFF_LOOP_TOKEN_IDS, parse_prompts, token_count
from http_frontend.parsing.body import off_loop


def test_token_count_reads_lengths_only() -> None:
    assert token_count({"prompt": [1, 2, 3]}) == 3
    assert token_count({"prompt": [[1, 2, 3, 4]]}) == 4  # a batch of one prompt
    assert token_count({"prompt": "text"}) == 0
    assert token_count({"prompt": ["a", "b"]}) == 2  # two text prompts: nothing to walk
    assert token_count({"prompt": [[1, 2], [3, 4, 5]]}) == 5  # a batch of token prompts
    assert OFF_LOOP_TOKEN_IDS < 1_000_000


def test_the_check_runs_in_the_parser_thread_and_refuses_there(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []

    def recording(body: dict) -> object:
        threads.append(threading.current_thread().name)
        return parse_prompts(body)

    monkeypatch.setattr(completions, "parse_prompts", recording)
    assert asyncio.run(off_loop(completions.parse_prompts, {"prompt": [1, 2]})) == [[1, 2]]
    with pytest.raises(APIError):
        asyncio.run(off_loop(completions.parse_prompts, {"prompt": [1, True]}))
    assert threads and all(name.startswith("json-body") for name in threads)
