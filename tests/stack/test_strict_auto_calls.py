"""Strict function tools under tool_choice "auto" through the real stack: SDK -> front-end -> engine -> MLX.

A strict tool's call was held to its schema only when forced; under "auto" (what agents send) the random
model's call was parsed, not constrained, and came back as junk or not at all. Here the model is pushed
into the call marker (a logit_bias on `<tool_call>`; Anthropic's API has none, so a copy of the tiny model
whose weights start every reply with it) and the call it then writes must follow the strict schema.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest
from mlx_lm.utils import load_tokenizer

from engine_daemon.sampling.strict_schema import strict_schema
from tests.helpers import Frontend, client_for

# Without strict's meaning the schema allows `{}` and any extra key; strict requires `z` and `n`, and nothing else.
LOOSE = {"type": "object", "properties": {"z": {"type": "string", "maxLength": 3},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
CLOSED = {**LOOSE, "additionalProperties": False}  # Anthropic's strict: closed, `required` as written (none)


@pytest.fixture(scope="module")
def marker(tiny_model: Path) -> int:
    return load_tokenizer(tiny_model).tool_call_start_tokens[0]


@pytest.fixture(scope="module")
def calls_first_model(tiny_model: Path, marker: int) -> str:
    """The tiny model with weights that start every reply with `<tool_call>` (then favour `<|im_end|>`)."""
    import mlx.core as mx

    from model_builders.ending import make_it_end

    out = tiny_model.parent / "tiny-calls-first"
    if not (out / "config.json").exists():  # written last
        out.mkdir(exist_ok=True)
        for path in tiny_model.iterdir():
            if path.is_file() and not path.name.startswith(".") and path.name not in ("config.json",
                                                                                       "model.safetensors"):
                shutil.copy(path, out / path.name)
        config = json.loads((tiny_model / "config.json").read_text())
        config["tie_word_embeddings"] = False
        config.pop("mlx_engined_build", None)
        weights = dict(mx.load(str(tiny_model / "model.safetensors")))
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        make_it_end(weights, config, [marker], int(config["eos_token_id"]), seed=0)
        mx.save_safetensors(str(out / "model.safetensors"), weights)
        (out / "config.json").write_text(json.dumps(config))
    return str(out)


def strict_tools(strict: bool = True) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "note", "description": "Records a note.", "parameters": LOOSE,
                                              "strict": strict}}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_strict_call_under_auto_follows_the_schema(frontend: Frontend, model_id: str, marker: int,
                                                     stream: bool) -> None:
    client = client_for(frontend)
    for seed in range(3):
        kwargs: dict[str, Any] = dict(
            model=model_id, messages=[{"role": "user", "content": "Note something."}], tools=strict_tools(),
            tool_choice="auto", parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120,
            logit_bias={str(marker): 100})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or []) if d.function]
            calls = [("".join(d.function.name or "" for d in deltas), "".join(d.function.arguments or ""
                                                                                for d in deltas))]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            finish = [choice.finish_reason]
            calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
        assert finish == ["tool_calls"] and len(calls) == 1, (finish, calls)
        name, arguments = calls[0]
        assert name == "note"
        jsonschema.validate(json.loads(arguments), strict_schema(LOOSE))


def test_a_strict_call_under_auto_over_responses(frontend: Frontend, model_id: str, marker: int) -> None:
    tools = [{"type": "function", "name": "note", "parameters": LOOSE, "strict": True}]
    for seed in range(2):
        response = client_for(frontend).responses.create(
            model=model_id, input="Note something.", tools=tools, tool_choice="auto", parallel_tool_calls=False,
            temperature=1.0, max_output_tokens=120, extra_body={"seed": seed, "logit_bias": {str(marker): 100}})
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert call.name == "note"
        jsonschema.validate(json.loads(call.arguments), strict_schema(LOOSE))


def test_a_strict_anthropic_tool_under_auto_follows_the_schema(frontend: Frontend, calls_first_model: str) -> None:
    client = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": "note", "description": "Records a note.", "input_schema": LOOSE, "strict": True}]
    for _ in range(3):  # sampled: each call another draw
        message = client.messages.create(
            model=calls_first_model, max_tokens=120, messages=[{"role": "user", "content": "Note something."}],
            tools=tools, tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            extra_body={"temperature": 1.0})
        (call,) = [block for block in message.content if block.type == "tool_use"]
        assert call.name == "note" and message.stop_reason == "tool_use", message
        jsonschema.validate(call.input, CLOSED)
