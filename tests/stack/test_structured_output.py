"""Structured output (`response_format`) and forced tool calls, enforced by constrained decoding.

The tiny model has random weights, so without the constraint its output is word
salad: every valid JSON document and every parsable tool call below is the
grammar's doing. In-process tests drive mlx-lm's own generators (BatchGenerator,
as the batch scheduler does, and generate_step, the serial --kv-bits path); the
end-to-end tests go through the real front-end and engine with the openai SDK.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, StopSequences, generate_step
from mlx_lm.sample_utils import make_logits_processors
from pydantic import BaseModel, Field

from engine_daemon.errors import RequestError
from engine_daemon.sampling.grammar import GrammarConstraint
from engine_daemon.sampling.samplers import make_request_sampler
from engine_daemon.sampling.structured import constraint_for
from tests.helpers import Frontend, client_for

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "nick": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
            "required": ["age", "nick"],
            "additionalProperties": False,
        },
    },
    "required": ["color", "count", "flags", "owner"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}},
]
PARAMS_BY_NAME = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> tuple[Any, Any]:
    return load(str(tiny_model))


def chat_prompt(tokenizer: Any, text: str, tools: list | None = None) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=tools,
                                              add_generation_prompt=True))


def run_batch(model: Any, tokenizer: Any, prompts: list[list[int]], processors: list[list[Any]],
              samplings: list[dict[str, Any]], max_tokens: int = 250) -> list[list[int]]:
    """Generates for all prompts in one BatchGenerator, as the batch scheduler does."""
    eos = StopSequences([[token] for token in tokenizer.eos_token_ids])
    generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts))
    try:
        uids = generator.insert(prompts, max_tokens=[max_tokens] * len(prompts),
                                samplers=[make_request_sampler(s) for s in samplings],
                                logits_processors=processors, stop_sequences=[eos] * len(prompts))
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        finished: set[int] = set()
        while len(finished) < len(uids):
            _, responses = generator.next()
            for response in responses:
                if response.token not in tokenizer.eos_token_ids:
                    out[response.uid].append(int(response.token))
                if response.finish_reason is not None:
                    assert response.finish_reason == "stop", "the grammar should end generation before max_tokens"
                    finished.add(response.uid)
        return [out[uid] for uid in uids]
    finally:
        generator.close()


def run_serial(model: Any, tokenizer: Any, prompt: list[int], processors: list[Any], sampling: dict[str, Any],
               max_tokens: int = 250) -> list[int]:
    """generate_step, the serial scheduler's generator."""
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                  sampler=make_request_sampler(sampling), logits_processors=processors):
        if token in tokenizer.eos_token_ids:
            return out
        out.append(int(token))
    raise AssertionError(f"no EOS within {max_tokens} tokens: {tokenizer.decode(out)!r}")


def tool_call_bodies(text: str) -> list[str]:
    assert re.fullmatch(r"(<tool_call>\n.*?\n</tool_call>\n?)+", text, re.S), text
    return re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)


# -- in process ----------------------------------------------------------------------

def test_unconstrained_output_is_not_json(tiny: tuple[Any, Any]) -> None:
    """The baseline the other tests beat: the random model does not write JSON by itself."""
    model, tokenizer = tiny
    prompt = chat_prompt(tokenizer, "Reply with a JSON object.")
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=40):
        tokens.append(token)
    text = tokenizer.decode(tokens)
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_schema_batched_greedy_and_sampled(tiny: tuple[Any, Any]) -> None:
    """Eight requests share a batch (greedy and seeded temperature 1.0); all produce schema-valid JSON."""
    model, tokenizer = tiny
    samplings = [{"temperature": 0.0}] + [{"temperature": 1.0, "seed": seed} for seed in range(7)]
    prompts = [chat_prompt(tokenizer, f"Describe thing number {n} as JSON.") for n in range(len(samplings))]
    constraints = [constraint_for(tokenizer, RESPONSE_FORMAT, None, None, None, False) for _ in prompts]
    outputs = run_batch(model, tokenizer, prompts, [[c] for c in constraints], samplings)
    documents = [json.loads(tokenizer.decode(tokens)) for tokens in outputs]
    for document in documents:
        jsonschema.validate(document, SCHEMA)
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 1, "sampled outputs should differ"
    assert all(c.done and not c.failed for c in constraints)


def test_constrained_and_free_requests_share_a_batch(tiny: tuple[Any, Any]) -> None:
    """A constraint only touches its own row: an unconstrained neighbour generates as if alone."""
    model, tokenizer = tiny
    free_prompt = chat_prompt(tokenizer, "Tell me a story.")
    reference = []  # greedy, 20 tokens, alone
    for token, _ in generate_step(mx.array(free_prompt), model, max_tokens=20):
        reference.append(int(token))
    eos = StopSequences([[t] for t in tokenizer.eos_token_ids])
    generator = BatchGenerator(model, max_tokens=250, completion_batch_size=2)
    try:
        constraint = constraint_for(tokenizer, RESPONSE_FORMAT, None, None, None, False)
        prompts = [chat_prompt(tokenizer, "JSON please"), free_prompt]
        uids = generator.insert(prompts, max_tokens=[250, 20], logits_processors=[[constraint], []],
                                stop_sequences=[eos, StopSequences([])])
        got: dict[int, list[int]] = {uid: [] for uid in uids}
        done: set[int] = set()
        while len(done) < 2:
            for response in generator.next()[1]:
                got[response.uid].append(int(response.token))
                if response.finish_reason:
                    done.add(response.uid)
    finally:
        generator.close()
    assert got[uids[1]] == reference
    assert got[uids[0]][-1] in tokenizer.eos_token_ids
    jsonschema.validate(json.loads(tokenizer.decode(got[uids[0]][:-1])), SCHEMA)


def test_json_schema_serial_path(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = chat_prompt(tokenizer, "JSON, serially.")
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        constraint = constraint_for(tokenizer, RESPONSE_FORMAT, None, None, None, False)
        tokens = run_serial(model, tokenizer, prompt, [constraint], sampling)
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)


def test_json_object(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = chat_prompt(tokenizer, "Any JSON object.")
    constraint = constraint_for(tokenizer, {"type": "json_object"}, None, None, None, False)
    # A random model would write an endless key (any token fits in a string): steer it away from
    # opening one, towards "}". Unconstrained, the same bias gives "}}}}...", not JSON.
    bias = make_logits_processors(logit_bias=json_object_bias(tokenizer))
    tokens = run_serial(model, tokenizer, prompt, bias + [constraint], {"temperature": 0.0})
    assert isinstance(json.loads(tokenizer.decode(tokens)), dict)


def json_object_bias(tokenizer: Any) -> dict[int, float]:
    """logit_bias that favours "}" and bars '{"' (opening a key), so an object closes quickly."""
    vocab = tokenizer.get_vocab()
    return {vocab["}"]: 8.0, vocab['{"']: -100.0}


def test_text_and_absent_formats_add_no_constraint(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    assert constraint_for(tokenizer, None, None, None, None, False) is None
    assert constraint_for(tokenizer, {"type": "text"}, None, None, None, False) is None
    assert constraint_for(tokenizer, None, TOOLS, "auto", None, False) is None
    assert constraint_for(tokenizer, None, TOOLS, "none", None, False) is None
    assert constraint_for(tokenizer, RESPONSE_FORMAT, TOOLS, "none", None, False) is not None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(tiny: tuple[Any, Any], choice: Any) -> None:
    model, tokenizer = tiny
    prompt = chat_prompt(tokenizer, "What is the weather?", tools=TOOLS)
    samplings = [{"temperature": 1.0, "seed": seed} for seed in range(4)]
    for parallel in (True, False):
        constraints = [constraint_for(tokenizer, None, TOOLS, choice, parallel, False) for _ in samplings]
        outputs = run_batch(model, tokenizer, [prompt] * len(samplings), [[c] for c in constraints], samplings)
        for tokens in outputs:
            bodies = tool_call_bodies(tokenizer.decode(tokens))
            assert tokens[0] == tokenizer.tool_call_start_tokens[0]  # the marker token, not spelled out
            if not parallel:
                assert len(bodies) == 1
            for body in bodies:
                call = tokenizer.tool_parser(body, TOOLS)  # mlx-lm's own parser for this family
                if isinstance(choice, dict):
                    assert call["name"] == "get_weather"
                jsonschema.validate(call["arguments"], PARAMS_BY_NAME[call["name"]])


def test_auto_tools_with_response_format_allow_either(tiny: tuple[Any, Any]) -> None:
    """tool_choice auto + response_format: the answer is the JSON, or a tool call instead."""
    _, tokenizer = tiny
    constraint = constraint_for(tokenizer, RESPONSE_FORMAT, TOOLS, "auto", None, False)
    logits = mx.zeros((1, 2048))
    masked = constraint(mx.array([1, 2, 3]), logits)
    allowed = {i for i, v in enumerate(masked[0].tolist()) if v != float("-inf")}
    assert tokenizer.tool_call_start_tokens[0] in allowed
    assert any(tokenizer.decode([i]).startswith("{") for i in allowed)
    assert len(allowed) < 10


def test_constraint_waits_for_the_end_of_thinking(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    constraint = constraint_for(tokenizer, RESPONSE_FORMAT, None, None, None, starts_in_thinking=True)
    prompt = [5, 6, *tokenizer.think_start_tokens]
    logits = mx.zeros((1, 2048))
    context = list(prompt)

    def step(token: int | None) -> set[int]:
        if token is not None:
            context.append(token)
        masked = constraint(mx.array(context), logits)
        return {i for i, v in enumerate(masked[0].tolist()) if v != float("-inf")}

    assert len(step(None)) == 2048  # reasoning is free
    assert len(step(100)) == 2048
    assert len(step(tokenizer.think_end_tokens[0])) < 10  # the answer is held to the schema
    assert not constraint.failed


def test_matcher_failure_forces_eos(tiny: tuple[Any, Any]) -> None:
    """A token the grammar forbids (only another processor could force one) ends the request, not the batch."""
    _, tokenizer = tiny
    constraint = constraint_for(tokenizer, RESPONSE_FORMAT, None, None, None, False)
    logits = mx.zeros((1, 2048))
    constraint(mx.array([1, 2]), logits)
    bad = tokenizer.encode("hello", add_special_tokens=False)[0]
    masked = constraint(mx.array([1, 2, bad]), logits)
    allowed = {i for i, v in enumerate(masked[0].tolist()) if v != float("-inf")}
    assert constraint.failed
    assert allowed == set(tokenizer.eos_token_ids)


def test_a_failed_constraint_ends_in_an_error_not_a_stop(tiny: tuple[Any, Any]) -> None:
    """Output the grammar gave up on does not follow the format: the client is told, not sent "stop"."""
    from engine_daemon.config import SchedulerConfig
    from engine_daemon.models.manager import ModelManager
    from engine_daemon.output.stop_strings import StopStringMatcher
    from engine_daemon.output.token_text import request_detokenizer
    from engine_daemon.request.state import EngineRequest
    from engine_daemon.scheduling.base import BaseScheduler
    from protocol import MsgType

    _, tokenizer = tiny
    scheduler = BaseScheduler(ModelManager(), SchedulerConfig())
    events = {}
    for failed in (False, True):
        constraint = constraint_for(tokenizer, RESPONSE_FORMAT, None, None, None, False)
        constraint(mx.array([1, 2]), mx.zeros((1, 2048)))
        if failed:
            constraint(mx.array([1, 2, tokenizer.encode("hello", add_special_tokens=False)[0]]), mx.zeros((1, 2048)))
        request = EngineRequest(rid=f"r{failed}", peer=b"p", body={}, prompt_tokens=[1, 2], max_tokens=50,
                                stop=StopStringMatcher(None), detokenizer=request_detokenizer(tokenizer, False),
                                eos_token_ids=frozenset(tokenizer.eos_token_ids), processors=[constraint])
        events[failed] = scheduler.token_event(request, min(tokenizer.eos_token_ids))
    assert events[False][1] == MsgType.DELTAS and events[False][2]["finish_reason"] == "stop"
    kind, body = events[True][1:]
    assert kind == MsgType.ERROR and body["status"] == 500 and body["code"] == "output_constraint_failed", body
    assert "json_schema" in body["message"] or "format" in body["message"], body


def test_a_completed_format_ends_the_reply_even_with_ignore_eos(frontend: Frontend, model_id: str) -> None:
    """Once the grammar is complete only EOS may follow: with ignore_eos every EOS came back as text."""
    schema = {"type": "string", "enum": ["yes", "no"]}
    reply = client_for(frontend).chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"ignore_eos": True})
    assert json.loads(reply.choices[0].message.content) in ("yes", "no"), reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens < 10, reply


def test_padded_output_layer_is_masked(tiny: tuple[Any, Any]) -> None:
    """Models often have more logits than tokenizer entries: the extra ids are never allowed."""
    _, tokenizer = tiny
    constraint = constraint_for(tokenizer, {"type": "json_object"}, None, None, None, False)
    masked = constraint(mx.array([1]), mx.ones((1, 2100)))
    assert masked.shape == (1, 2100)
    assert all(v == float("-inf") for v in masked[0, 2048:].tolist())


class _OtherFamily:
    """The tiny tokenizer posing as another model family (only the tool-call attributes change)."""

    def __init__(self, wrapper: Any, parser_module: str | None, template: str = ""):
        import importlib

        self._wrapper = wrapper
        module = importlib.import_module(f"mlx_lm.tool_parsers.{parser_module}") if parser_module else None
        self.tool_parser = module.parse_tool_call if module else None
        self.tool_call_start = module.tool_call_start if module else None
        self.tool_call_end = module.tool_call_end if module else None
        self.tool_call_start_tokens = None
        self.tool_call_end_tokens = None
        self.chat_template = template
        self._tokenizer = wrapper._tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper, name)


def random_walk(constraint: GrammarConstraint, tokenizer: Any, seed: int, limit: int = 300) -> str:
    """Samples uniformly among the tokens the grammar allows, until only EOS is left."""
    key = mx.random.key(seed)
    context = [1]
    logits = mx.zeros((1, 2048))
    for _ in range(limit):
        masked = constraint(mx.array(context), logits)
        key, draw = mx.random.split(key)
        token = int(mx.random.categorical(masked, key=draw).item())
        if token in tokenizer.eos_token_ids:
            return tokenizer.decode(context[1:])
        context.append(token)
    raise AssertionError("the grammar did not finish")


@pytest.mark.parametrize("family,template", [("mistral", "[TOOL_CALLS] ["), ("mistral", "{{ '[ARGS]' }}"),
                                             (None, 'Respond with {"name": ..., "parameters": ...}')])
def test_other_json_families_parse_with_their_parser(tiny: tuple[Any, Any], family: str | None,
                                                     template: str) -> None:
    _, tokenizer = tiny
    other = _OtherFamily(tokenizer, family, template)
    for seed in range(3):
        constraint = constraint_for(other, None, TOOLS, "required", True, False)
        text = random_walk(constraint, tokenizer, seed)
        if family is None:
            parsed = json.loads(text)
            calls = parsed if isinstance(parsed, list) else [parsed]
            assert all(set(call) == {"name", "parameters"} for call in calls)
            calls = [{"name": c["name"], "arguments": c["parameters"]} for c in calls]
        else:
            assert text.startswith(other.tool_call_start)
            parsed = other.tool_parser(text[len(other.tool_call_start):], TOOLS)
            calls = parsed if isinstance(parsed, list) else [parsed]
        for call in calls:
            jsonschema.validate(call["arguments"], PARAMS_BY_NAME[call["name"]])


def test_non_json_tool_formats_are_refused(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    other = _OtherFamily(tokenizer, "pythonic")
    with pytest.raises(RequestError) as info:
        constraint_for(other, None, TOOLS, "required", None, False)
    assert info.value.status == 400 and info.value.param == "tool_choice"
    # With tool_choice auto the JSON answer is still enforced; calls are just not offered beside it.
    assert constraint_for(other, RESPONSE_FORMAT, TOOLS, "auto", None, False) is not None


RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
# A flat chain of $defs, each an array of the next: 1,200 of them crashed the engine in llguidance's compile.
CHAIN = {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"],
         "$defs": {**{f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(1200)},
                   "d1200": {"type": "integer"}}}


@pytest.mark.parametrize("response_format,tools,tool_choice,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}, None, None,
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}}, None,
     None, "response_format.json_schema.schema"),
    ({"type": "json_schema"}, None, None, "response_format.json_schema"),
    ({"type": "regex", "regex": "a+"}, None, None, "response_format.type"),
    ("json", None, None, "response_format"),
    (None, TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, None, "required", "tool_choice"),
    (None, TOOLS, "sometimes", "tool_choice"),
    (None, [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": "x"}}}],
     "required", "tools[0].function.parameters"),
    # Compiles, then fails on its first mask (llguidance's item limit): was a 200 with no call at all.
    (None, [{"type": "function", "function": {"name": "f", "parameters": RECURSIVE}}], "required", "tool_choice"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": CHAIN}}, None, None, "response_format"),
    (None, [{"type": "function", "function": {"name": "f", "parameters": CHAIN}}], "required",
     "tools[0].function.parameters"),
    # Past MAX_CONSTRAINT_BYTES: refused before compiling (a 10 MB enum took ~8 s to refuse).
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [f"v{i}" for i in range(200_000)]}}},
     None, None, "response_format"),
])
def test_bad_formats_are_400(tiny: tuple[Any, Any], response_format: Any, tools: Any, tool_choice: Any,
                             param: str) -> None:
    _, tokenizer = tiny
    with pytest.raises(RequestError) as info:
        constraint_for(tokenizer, response_format, tools, tool_choice, None, False)
    assert info.value.status == 400
    assert info.value.param == param
    # The reason, without llguidance's matcher state and grammar text (a ~1 KB quote of our own grammar).
    assert str(info.value) and "<state>" not in str(info.value) and "<grammar>" not in str(info.value)
    assert len(str(info.value)) < 400, str(info.value)


def test_unenforceable_keywords_are_refused_not_ignored(tiny: tuple[Any, Any]) -> None:
    """A schema keyword llguidance cannot enforce (here "uniqueItems") is a 400 naming it."""
    _, tokenizer = tiny
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(RequestError) as info:
        constraint_for(tokenizer, {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                       None, None, None, False)
    assert "uniqueItems" in str(info.value)
    assert "%json" not in str(info.value)  # the engine's grammar text is not leaked into the message


# -- end to end: openai SDK -> front-end -> engine -------------------------------------

def test_twenty_schema_requests_all_validate(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)

    def ask(seed: int) -> tuple[str, str]:
        result = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Describe a thing as JSON."}],
            response_format=RESPONSE_FORMAT, temperature=1.0, seed=seed, max_tokens=250)
        return result.choices[0].message.content, result.choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(ask, range(20)))
    for content, finish_reason in results:
        assert finish_reason == "stop", content
        jsonschema.validate(json.loads(content), SCHEMA)
    assert len({content for content, _ in results}) > 10


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=4)


class Household(BaseModel):
    pets: list[Pet] = Field(max_length=2)
    rooms: int = Field(ge=1, le=9)
    rented: bool


def test_sdk_parse_returns_a_parsed_object(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    completion = client.chat.completions.parse(
        model=model_id, messages=[{"role": "user", "content": "Describe a household."}],
        response_format=Household, temperature=1.0, seed=7, max_tokens=250)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Household)
    assert 1 <= parsed.rooms <= 9


def test_json_object_over_http(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    result = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format={"type": "json_object"}, max_tokens=250, temperature=0,
        logit_bias={str(token): bias for token, bias in json_object_bias(http_tokenizer(model_id)).items()})
    assert isinstance(json.loads(result.choices[0].message.content), dict)


def http_tokenizer(model_id: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_id)


def test_bad_schema_is_a_400_over_http(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    assert info.value.status_code == 400
    assert "schema" in (info.value.body or {}).get("param", "")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_over_http(frontend: Frontend, model_id: str, stream: bool) -> None:
    client = client_for(frontend)
    kwargs = dict(model=model_id, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
                  tool_choice="required", temperature=1.0, seed=11, max_tokens=250, parallel_tool_calls=False)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        deltas = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
        assert finish == ["tool_calls"]
        name = "".join(d.function.name or "" for d in deltas if d.function)
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        calls = [(name, arguments)]
    else:
        result = client.chat.completions.create(**kwargs)
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert len(calls) == 1
    name, arguments = calls[0]
    assert name in PARAMS_BY_NAME
    jsonschema.validate(json.loads(arguments), PARAMS_BY_NAME[name])


def test_named_tool_choice_over_http(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    result = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, temperature=1.0, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=250)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert {call.function.name for call in choice.message.tool_calls} == {"get_weather"}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


def test_logprobs_of_a_constrained_reply_are_finite_json(frontend: Frontend, model_id: str) -> None:
    """Masked tokens have logprob -inf: top_logprobs must still be valid JSON numbers."""
    response = httpx.post(f"{frontend.base_url}/v1/chat/completions", timeout=60, json={
        "model": model_id, "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 250,
        "temperature": 0, "response_format": RESPONSE_FORMAT, "logprobs": True, "top_logprobs": 5})
    assert response.status_code == 200, response.text
    body = json.loads(response.text, parse_constant=lambda name: pytest.fail(f"non-JSON number {name}"))
    entries = body["choices"][0]["logprobs"]["content"]
    assert entries and all(len(entry["top_logprobs"]) == 5 for entry in entries)
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
