"""LangChain's `ChatOpenAI` (langchain-openai), unmodified, against the real stack.

Chat Completions and, with `use_responses_api=True`, the Responses API: invoke, stream,
forced tool calls with a tool-result turn, and `with_structured_output`. Nothing may
download at test time, so tiktoken (langchain's token counter, which fetches its
encodings on first use) is made to fail loudly: the calls below must not need it.
Determinism comes from greedy decoding, `ignore_eos` + a token budget, and constrained
decoding (strict tool schemas with bounded strings, json_schema output).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator
from typing import Any, Literal

import pytest
import tiktoken
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.helpers import Frontend

STORY = "Tell me a story."


class GetWeather(BaseModel):
    """Current weather in a city."""

    # Bounded: the random-weight model would otherwise fill the string up to max_tokens.
    city: str = Field(max_length=16, description="City name")
    unit: Literal["C", "F"]


class Thing(BaseModel):
    color: Literal["red", "green", "blue"]
    nick: str = Field(max_length=6)


@pytest.fixture(autouse=True, scope="module")
def no_downloads() -> Iterator[None]:
    """tiktoken would download its encodings; tracing would post to LangSmith. Neither may happen."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"tiktoken was asked for an encoding {args}: that would download at test time")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiktoken, "get_encoding", refuse)
        patch.setattr(tiktoken, "encoding_for_model", refuse)
        for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY"):
            patch.delenv(name, raising=False)
        yield


def chat_model(frontend: Frontend, model_id: str, **options: Any) -> ChatOpenAI:
    options.setdefault("max_tokens", 12)
    return ChatOpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", model=model_id, temperature=0,
                      max_retries=0, timeout=60, **options)


def joined(chunks: Iterator[AIMessageChunk]) -> AIMessageChunk:
    """The chunks added up, as LangChain's own aggregation does."""
    return functools.reduce(operator.add, chunks)


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_invoke_and_stream_agree(frontend: Frontend, model_id: str, responses_api: bool) -> None:
    llm = chat_model(frontend, model_id, stream_usage=True, use_responses_api=responses_api,
                     extra_body={"ignore_eos": True})
    message = llm.invoke(STORY)
    assert isinstance(message, AIMessage) and message.text
    assert message.usage_metadata["output_tokens"] == 12
    assert message.usage_metadata["total_tokens"] == message.usage_metadata["input_tokens"] + 12
    if responses_api:
        assert message.response_metadata["id"].startswith("resp_")
        assert message.response_metadata["status"] == "incomplete"
        assert message.response_metadata["incomplete_details"] == {"reason": "max_output_tokens"}
        # The same prompt reaches the model through either API: greedy gives the same text.
        assert message.text == chat_model(frontend, model_id, extra_body={"ignore_eos": True}).invoke(STORY).text
    else:
        assert isinstance(message.content, str) and message.response_metadata["finish_reason"] == "length"
        assert message.response_metadata["id"].startswith("chatcmpl-")
    chunks = list(llm.stream(STORY))
    assert len(chunks) > 2
    streamed = joined(iter(chunks))
    assert streamed.text == message.text
    assert streamed.usage_metadata["output_tokens"] == 12
    assert streamed.usage_metadata["input_tokens"] == message.usage_metadata["input_tokens"]


def _tool_round(frontend: Frontend, model_id: str, responses_api: bool) -> tuple[AIMessage, AIMessage]:
    """A forced GetWeather call, then the answer to its result: (the call, the answer)."""
    llm = chat_model(frontend, model_id, max_tokens=120, use_responses_api=responses_api)
    with_tools = llm.bind_tools([GetWeather], tool_choice="required", parallel_tool_calls=False, strict=True)
    question = HumanMessage("What is the weather in Paris?")
    called = with_tools.invoke([question])
    assert len(called.tool_calls) == 1, called
    turn: list[BaseMessage] = [question, called, ToolMessage("18 C and sunny",
                                                             tool_call_id=called.tool_calls[0]["id"])]
    answer = chat_model(frontend, model_id, max_tokens=4, use_responses_api=responses_api,
                        extra_body={"ignore_eos": True}).invoke(turn)
    return called, answer


def test_bind_tools_required_gives_a_parsed_call(frontend: Frontend, model_id: str) -> None:
    called, answer = _tool_round(frontend, model_id, responses_api=False)
    (call,) = called.tool_calls
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    weather = GetWeather.model_validate(call["args"])  # bounded city, unit from the enum
    assert set(call["args"]) == {"city", "unit"} and weather.unit in ("C", "F")
    assert called.response_metadata["finish_reason"] == "tool_calls" and not called.text
    assert not called.invalid_tool_calls
    # Streamed: LangChain assembles the tool_call_chunks into the same call.
    with_tools = chat_model(frontend, model_id, max_tokens=120).bind_tools(
        [GetWeather], tool_choice="required", parallel_tool_calls=False, strict=True)
    streamed = joined(with_tools.stream("What is the weather in Paris?"))
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    assert streamed.response_metadata["finish_reason"] == "tool_calls"
    # LangChain sends the call and its ToolMessage back as an assistant tool_calls turn and a tool message.
    assert answer.text and answer.usage_metadata["output_tokens"] == 4


def test_responses_api_tool_round_matches_chat(frontend: Frontend, model_id: str) -> None:
    """Through the Responses API (function_call / function_call_output items) the same turn is the same prompt."""
    chat_called, chat_answer = _tool_round(frontend, model_id, responses_api=False)
    called, answer = _tool_round(frontend, model_id, responses_api=True)
    (call,) = called.tool_calls
    assert call["name"] == "GetWeather" and call["args"] == chat_called.tool_calls[0]["args"]
    assert answer.usage_metadata["output_tokens"] == 4
    assert answer.usage_metadata["input_tokens"] == chat_answer.usage_metadata["input_tokens"]
    assert answer.text == chat_answer.text


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_with_structured_output_returns_the_model(frontend: Frontend, model_id: str, responses_api: bool) -> None:
    llm = chat_model(frontend, model_id, max_tokens=200, use_responses_api=responses_api)
    structured = llm.with_structured_output(Thing, method="json_schema", strict=True, include_raw=True)
    result = structured.invoke("Describe a thing.")
    assert result["parsing_error"] is None, result
    thing = result["parsed"]
    assert isinstance(thing, Thing) and len(thing.nick) <= 6
    assert Thing.model_validate_json(result["raw"].text) == thing
