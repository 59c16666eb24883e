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


def first_entry(token: str) -> dict[str, Any]:
    """A prompt's first token as the engine sends it: nothing predicts it."""
    return {"token": token, "logprob": None, "bytes": list(token.encode()), "top_logprobs": None}


PROMPT_SCRIPT = [{"text": "", "prompt_logprobs": [first_entry("Say")]},
                 {"text": "", "prompt_logprobs": [entry(":", -2.0, (" so", -1.0)), entry(" ", -3.0, ("x", -0.5))]},
                 *SCRIPT]


def test_echo_with_logprobs_asks_for_the_prompts_and_puts_them_first() -> None:
    """What lm-evaluation-harness's loglikelihood sends: `echo`, `logprobs`, and reads token_logprobs[ctxlen:-1]."""
    engine = FakeEngine(script=lambda request: list(PROMPT_SCRIPT))
    result = client_for(engine).simulate_post("/v1/completions", json={"prompt": "Say: ", "echo": True,
                                                                        "logprobs": 1, "max_tokens": 2})
    assert result.status_code == 200, result.text
    assert engine.added[0]["params"]["prompt_logprobs"] == 1 and engine.added[0]["params"]["top_logprobs"] == 1
    choice = result.json["choices"][0]
    assert choice["text"] == "Say: Hello"
    assert choice["logprobs"] == {
        "tokens": ["Say", ":", " ", "Hel", "lo"], "token_logprobs": [None, -2.0, -3.0, -0.5, -0.25],
        "top_logprobs": [None, {" so": -1.0}, {"x": -0.5}, {"Hel": -0.5, "He": -1.5}, {"lo": -0.25, "p": -2.0}],
        "text_offset": [0, 3, 4, 5, 8]}
    # Without `echo` nothing asks for the prompt's.
    client_for(engine).simulate_post("/v1/completions", json={"prompt": "Say: ", "logprobs": 1})
    assert "prompt_logprobs" not in engine.added[1]["params"]


def test_scoring_only_takes_max_tokens_0_and_streams_the_echo_with_the_prompts_logprobs() -> None:
    scored = [*PROMPT_SCRIPT[:2], {"finish_reason": "length", "usage": usage(0)}]
    engine = FakeEngine(script=lambda request: list(scored))
    result = client_for(engine).simulate_post("/v1/completions", json={"prompt": "Say: ", "echo": True,
                                                                        "logprobs": 0, "max_tokens": 0})
    assert result.status_code == 200, result.text
    assert engine.added[0]["params"]["max_tokens"] == 0
    assert result.json["choices"][0]["text"] == "Say: " and result.json["choices"][0]["finish_reason"] == "length"
    assert result.json["choices"][0]["logprobs"]["token_logprobs"] == [None, -2.0, -3.0]
    streamed = client_for(FakeEngine(script=lambda request: list(scored))).simulate_post(
        "/v1/completions", json={"prompt": "Say: ", "echo": True, "logprobs": 0, "max_tokens": 0, "stream": True})
    chunks = [json.loads(data)["choices"][0] for _, data in sse_events(streamed.text) if data != "[DONE]"]
    # The echo rides on the first prompt entries (not sent ahead of them); later entries come with no text.
    assert [c["text"] for c in chunks] == ["Say: ", "", ""]
    assert [c["logprobs"]["tokens"] if c["logprobs"] else None for c in chunks] == [["Say"], [":", " "], None]
    assert [c["logprobs"]["text_offset"] if c["logprobs"] else None for c in chunks] == [[0], [3, 4], None]
    assert chunks[-1]["finish_reason"] == "length"


def test_an_engine_without_prompt_logprobs_is_not_asked_for_them() -> None:
    """An engine from before `PROMPT_LOGPROBS` would ignore the param and answer without the prompt's entries."""
    import asyncio

    from http_frontend.engine.client import EngineClient
    from http_frontend.engine.request_stream import EngineError
    from protocol.messages import PROMPT_LOGPROBS

    async def scenario(features: frozenset[str]) -> tuple[list[bytes], Any]:
        client = EngineClient("ipc:///nonexistent")
        sent: list[bytes] = []

        async def ready(timeout: float) -> bool:
            return True

        client.wait_ready = ready  # type: ignore[method-assign]
        client._send_frame = lambda frame: sent.append(frame) or True  # type: ignore[method-assign]
        client.features = features
        stream = await client.submit({"model": "m", "prompt": "x", "params": {"prompt_logprobs": 1}})
        try:
            await stream.wait_accepted(0.01)
        except EngineError as exc:
            return sent, exc
        except asyncio.TimeoutError:
            return sent, None
        return sent, None

    sent, error = asyncio.run(scenario(frozenset()))
    assert not sent and error is not None and error.body["status"] == 400 and error.body["param"] == "logprobs"
    sent, error = asyncio.run(scenario(frozenset({PROMPT_LOGPROBS})))
    assert len(sent) == 1 and error is None


def test_an_array_of_prompts_answers_each_prompts_choices_in_order() -> None:
    """OpenAI's prompt arrays (and lm-eval's batches): choice p * n + i is prompt p's i-th, each echo its own,
    usage counting each prompt once."""
    def script(request: dict[str, Any]) -> list[dict[str, Any]]:
        words = len(request["prompt"].split())
        return [{"text": f"<{request['prompt']}>", "token_ids": [1]},
                {"finish_reason": "length", "usage": usage(1, prompt_tokens=words)}]

    engine = FakeEngine(script=script)
    body = {"prompt": ["one", "two words", "three more words"], "n": 2, "echo": True, "max_tokens": 1}
    result = client_for(engine).simulate_post("/v1/completions", json=body)
    assert result.status_code == 200, result.text
    assert [c["index"] for c in result.json["choices"]] == list(range(6))
    assert [c["text"] for c in result.json["choices"]] == [
        "one<one>", "one<one>", "two words<two words>", "two words<two words>",
        "three more words<three more words>", "three more words<three more words>"]
    assert [request["prompt"] for request in engine.added] == ["one", "one", "two words", "two words",
                                                               "three more words", "three more words"]
    assert result.json["usage"]["prompt_tokens"] == 1 + 2 + 3 and result.json["usage"]["completion_tokens"] == 6

    streamed = client_for(FakeEngine(script=script)).simulate_post(
        "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(data) for _, data in sse_events(streamed.text) if data != "[DONE]"]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {i: c["text"] for i, c in enumerate(result.json["choices"])}
    assert chunks[-1]["usage"]["prompt_tokens"] == 6 and chunks[-1]["usage"]["completion_tokens"] == 6
