"""`/v1/completions` `logprobs` (the legacy shape) and `echo`, in-process around a `FakeEngine`."""

from __future__ import annotations

import json
from typing import Any

from http_frontend.relay.legacy_logprobs import LegacyLogprobs
from tests.unit.fake_engine import FakeEngine, client_for, sse_events, usage


def entry(token: str, logprob: float, *alternatives: tuple[str, float]) -> dict[str, Any]:
    """One chat-shaped logprobs entry, as the engine sends it."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives]}


SCRIPT = [{"text": "Hel", "token_ids": [1], "logprobs": [entry("Hel", -0.5, ("Hel", -0.5), ("He", -1.5))]},
          {"text": "lo", "token_ids": [2], "logprobs": [entry("lo", -0.25, ("lo", -0.25), ("p", -2.0))]},
          {"finish_reason": "length", "usage": usage(2)}]


def test_legacy_logprobs_are_parallel_lists_whose_offsets_run_on_across_chunks() -> None:
    legacy = LegacyLogprobs()
    first = legacy.render([entry("Hel", -0.5, ("Hel", -0.5), ("He", -1.5))])
    second = legacy.render([entry("bytes:\\xe2", -1.0), entry("lo", -0.25)])
    assert first == {"tokens": ["Hel"], "token_logprobs": [-0.5], "top_logprobs": [{"Hel": -0.5, "He": -1.5}],
                     "text_offset": [0]}
    assert second["text_offset"] == [3, 3]  # a partial character's token adds no text of its own
    assert second["top_logprobs"] == [{}, {}]


def test_logprobs_come_back_in_the_legacy_shape_and_ask_the_engine_for_alternatives() -> None:
    engine = FakeEngine(script=lambda request: list(SCRIPT))
    result = client_for(engine).simulate_post("/v1/completions", json={"prompt": "x", "logprobs": 2})
    assert result.status_code == 200, result.text
    assert engine.added[0]["params"]["logprobs"] is True and engine.added[0]["params"]["top_logprobs"] == 2
    choice = result.json["choices"][0]
    assert choice["text"] == "Hello" and choice["logprobs"] == {
        "tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hel": -0.5, "He": -1.5}, {"lo": -0.25, "p": -2.0}], "text_offset": [0, 3]}
    plain = client_for(FakeEngine(script=lambda request: list(SCRIPT))).simulate_post(
        "/v1/completions", json={"prompt": "x"})
    assert plain.json["choices"][0]["logprobs"] is None


def test_streamed_logprobs_ride_on_each_chunk() -> None:
    engine = FakeEngine(script=lambda request: list(SCRIPT))
    result = client_for(engine).simulate_post("/v1/completions", json={"prompt": "x", "logprobs": 0, "stream": True})
    chunks = [json.loads(data) for _, data in sse_events(result.text) if data != "[DONE]"]
    logprobs = [chunk["choices"][0]["logprobs"] for chunk in chunks if chunk["choices"][0]["text"]]
    assert [lp["tokens"] for lp in logprobs] == [["Hel"], ["lo"]]
    assert [lp["text_offset"] for lp in logprobs] == [[0], [3]]


def test_echo_puts_the_prompt_first_and_reads_token_ids_back_through_the_engine() -> None:
    engine = FakeEngine(script=lambda request: list(SCRIPT))
    result = client_for(engine).simulate_post("/v1/completions", json={"prompt": "Say: ", "echo": True})
    assert result.json["choices"][0]["text"] == "Say: Hello"
    result = client_for(engine).simulate_post("/v1/completions", json={"prompt": [1, 2, 3], "echo": True})
    assert result.json["choices"][0]["text"] == "abcHello"  # the fake's tokenizer: 1 -> "a"
    assert ("detokenize", {"model": None, "tokens": [1, 2, 3]}) in engine.calls
    streamed = client_for(engine).simulate_post("/v1/completions", json={"prompt": "Say: ", "echo": True,
                                                                          "stream": True})
    texts = [json.loads(data)["choices"][0]["text"] for _, data in sse_events(streamed.text) if data != "[DONE]"]
    assert texts[0] == "Say: " and "".join(texts) == "Say: Hello"
