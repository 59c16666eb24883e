"""Grammar-level checks of the output constraint (`constraint_for`) on the tiny model's tokenizer.

- Text a grammar forces that equals a special token's text (`</think>`, `<tool_call>`) is spelled
  with ordinary tokens: the special token was the only one allowed there, the matcher then refused
  it, and the request failed with a 500 whatever the sampling.
- `strict: true` schemas hold the output to the keys they name, all of them, even when the schema
  does not say `additionalProperties: false` / `required` itself.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from engine_daemon.sampling.grammar import GrammarConstraint
from engine_daemon.sampling.schema_depth import MAX_SCHEMA_DEPTH
from engine_daemon.sampling.strict_schema import strict_schema
from engine_daemon.sampling.structured import constraint_for, llg_tokenizer
from tests.unit.grammar_checks import accepts, allowed_ids

SPECIAL_TEXTS = ["</think>", "<tool_call>", "</tool_call>", "<|im_end|>"]
LOOSE = {"type": "object", "properties": {"z": {"type": "string", "maxLength": 3}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(tiny_model)


def walk(constraint: GrammarConstraint, tokenizer: Any, seed: int, limit: int = 200) -> list[int]:
    """Samples uniformly among the allowed tokens, as a generator would, until EOS; the tokens before it."""
    key, context = mx.random.key(seed), [1]
    logits = mx.zeros((1, llg_tokenizer(tokenizer).vocab_size))
    for _ in range(limit):
        masked = constraint(mx.array(context), logits)
        key, draw = mx.random.split(key)
        token = int(mx.random.categorical(masked, key=draw).item())
        if token in tokenizer.eos_token_ids:
            assert not constraint.failed
            return context[1:]
        context.append(token)
    raise AssertionError(f"the grammar did not finish: {tokenizer.decode(context[1:])!r}")


def json_schema_format(schema: Any, strict: bool | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "x", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


# -- a forced literal equal to a special token's text ---------------------------------

def test_the_llguidance_tokenizer_encodes_text_without_special_tokens(tokenizer: Any) -> None:
    """What llguidance forces is encoded by this tokenizer: special texts come out as ordinary tokens."""
    vocabulary = llg_tokenizer(tokenizer)
    for text in ["a </think> b<|im_end|>", *SPECIAL_TEXTS, "plain"]:
        ids = vocabulary.tokenize_str(text)
        assert not [token for token in ids if vocabulary.is_special_token(token)], (text, ids)
        assert vocabulary.decode_bytes(ids) == text.encode()
    # The vocabulary itself is unchanged: the markers are still special tokens, named as before.
    marker = tokenizer.tool_call_start_tokens[0]
    assert vocabulary.is_special_token(marker) and vocabulary.decode_str([marker]) == "<tool_call>"
    assert vocabulary.vocab_size == len(tokenizer.get_vocab())


@pytest.mark.parametrize("text", SPECIAL_TEXTS)
def test_a_const_equal_to_a_special_token_is_spelled_in_text(tokenizer: Any, text: str) -> None:
    schema = {"type": "object", "properties": {"v": {"type": "string", "const": text}}, "required": ["v"],
              "additionalProperties": False}
    vocabulary = llg_tokenizer(tokenizer)
    for seed in range(2):
        constraint = constraint_for(tokenizer, json_schema_format(schema), None, None, None, False)
        tokens = walk(constraint, tokenizer, seed)
        assert json.loads(tokenizer.decode(tokens)) == {"v": text}
        assert not any(vocabulary.is_special_token(token) for token in tokens), tokens
    constraint = constraint_for(tokenizer, json_schema_format(schema), None, None, None, False)
    assert accepts(constraint.matcher, tokenizer, json.dumps({"v": text}))


def test_a_forced_tool_argument_equal_to_a_marker_keeps_the_markers_as_tokens(tokenizer: Any) -> None:
    """The call's own markers stay single special tokens; the same text in an argument is plain text."""
    tools = [{"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"v": {"type": "string", "enum": ["<tool_call>"]}}, "required": ["v"],
        "additionalProperties": False}}}]
    for seed in range(3):
        constraint = constraint_for(tokenizer, None, tools, "required", False, False)
        tokens = walk(constraint, tokenizer, seed)
        start, end = tokenizer.tool_call_start_tokens, tokenizer.tool_call_end_tokens
        assert tokens[:len(start)] == list(start) and tokens[-len(end):] == list(end)
        body = tokenizer.decode(tokens[len(start):-len(end)])
        assert json.loads(body) == {"name": "echo", "arguments": {"v": "<tool_call>"}}


def test_a_custom_tool_regex_equal_to_a_marker(tokenizer: Any) -> None:
    """A Responses custom tool whose regex grammar is `</tool_call>` (its input, as the front-end sends it)."""
    tools = [{"type": "function", "function": {"name": "c", "parameters": {
        "type": "object", "properties": {"input": {"type": "string", "pattern": "^(?:</tool_call>)$"}},
        "required": ["input"], "additionalProperties": False}}}]
    constraint = constraint_for(tokenizer, None, tools, "required", False, False)
    tokens = walk(constraint, tokenizer, 0)
    body = tokenizer.decode(tokens[1:-1])
    assert json.loads(body)["arguments"] == {"input": "</tool_call>"}


def test_special_tokens_are_never_allowed_as_text(tokenizer: Any) -> None:
    """Where a grammar wants any text (a free string), no special token is in the mask."""
    constraint = constraint_for(tokenizer, json_schema_format({"type": "string"}), None, None, None, False)
    vocabulary = llg_tokenizer(tokenizer)
    matcher = constraint.matcher.deep_copy()
    assert matcher.consume_token(tokenizer.encode('"', add_special_tokens=False)[0])
    allowed = allowed_ids(matcher, vocabulary.vocab_size)
    assert len(allowed) > 1000
    assert not [token for token in allowed if vocabulary.is_special_token(token)]


# -- strict: true ---------------------------------------------------------------------

@pytest.mark.parametrize("where", ["response_format", "tool"])
def test_strict_closes_objects_and_requires_their_properties(tokenizer: Any, where: str) -> None:
    def build(strict: bool | None) -> GrammarConstraint:
        if where == "response_format":
            return constraint_for(tokenizer, json_schema_format(LOOSE, strict), None, None, None, False)
        function: dict[str, Any] = {"name": "f", "parameters": LOOSE}
        if strict is not None:
            function["strict"] = strict
        return constraint_for(tokenizer, None, [{"type": "function", "function": function}],
                              {"type": "function", "function": {"name": "f"}}, False, False)

    def body_accepted(constraint: GrammarConstraint, arguments: str) -> bool:
        if where == "response_format":
            return accepts(constraint.matcher, tokenizer, arguments)
        matcher = constraint.matcher.deep_copy()  # the call: its markers are tokens, its body text
        assert matcher.consume_token(tokenizer.tool_call_start_tokens[0])
        return accepts(matcher, tokenizer, f'\n{{"name": "f", "arguments": {arguments}}}\n',
                       then=tuple(tokenizer.tool_call_end_tokens))

    strict, loose = build(True), build(None)
    assert body_accepted(strict, '{"z": "ab"}')
    assert not body_accepted(strict, '{"z": "ab", "q": 1}')  # a key the schema never named
    assert not body_accepted(strict, "{}")  # a named key left out
    # Without strict, the schema means what JSON Schema says: both are valid.
    assert body_accepted(loose, '{"z": "ab", "q": 1}') and body_accepted(loose, "{}")
    assert body_accepted(build(False), "{}")


def test_strict_schema_walks_subschemas_and_leaves_the_client_schema_alone() -> None:
    schema = {
        "type": "object",
        "properties": {
            "o": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "l": {"type": "array", "items": {"$ref": "#/$defs/P"}},
            "u": {"anyOf": [{"type": "object", "properties": {"q": {}}}, {"type": "null"}]},
            "open": {"type": "object", "properties": {"k": {}}, "additionalProperties": True, "required": []},
            "c": {"const": {"type": "object", "properties": {"x": {}}}},
        },
        "$defs": {"P": {"properties": {"x": {"type": "string"}}}},
    }
    before = copy.deepcopy(schema)
    strict = strict_schema(schema)
    assert schema == before  # the client's dict (also the prompt's tool list) is untouched
    assert strict["additionalProperties"] is False and strict["required"] == ["o", "l", "u", "open", "c"]
    properties = strict["properties"]
    assert properties["o"]["additionalProperties"] is False and properties["o"]["required"] == ["a"]
    assert properties["u"]["anyOf"][0]["required"] == ["q"] and properties["u"]["anyOf"][1] == {"type": "null"}
    assert strict["$defs"]["P"] == {"properties": {"x": {"type": "string"}}, "additionalProperties": False,
                                    "required": ["x"]}
    assert properties["l"] == {"type": "array", "items": {"$ref": "#/$defs/P"}}
    assert properties["open"] == before["properties"]["open"]  # what a schema says itself is kept
    assert properties["c"] == before["properties"]["c"]  # a const is data, not a schema
    assert strict_schema(True) is True


def test_strict_schema_is_bounded_and_iterative() -> None:
    """A schema nested far past MAX_SCHEMA_DEPTH (refused later) costs no recursion and stops at the bound."""
    deep: dict[str, Any] = {"type": "object", "properties": {}}
    node = deep
    for _ in range(5 * MAX_SCHEMA_DEPTH):
        child: dict[str, Any] = {"type": "object", "properties": {}}
        node["properties"]["n"] = child
        node = child
    strict = strict_schema(deep)
    node, closed = strict, 0
    while node is not None:
        closed += node.get("additionalProperties") is False
        node = node["properties"].get("n")
    assert closed == MAX_SCHEMA_DEPTH + 1


def test_anthropic_structured_outputs_keep_properties_left_out_of_required_optional(tokenizer: Any) -> None:
    """Anthropic's `output_config.format` is not OpenAI's strict: a property its schema does not require may be
    left out (the closing `additionalProperties: false` is the schema's own, as Anthropic asks)."""
    from http_frontend.anthropic.request import parse_output_format

    schema = {"type": "object", "properties": {"z": {"type": "string", "maxLength": 3}, "y": {"type": "integer"}},
              "additionalProperties": False}
    response_format = parse_output_format({"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    constraint = constraint_for(tokenizer, response_format, None, None, None, False)
    assert accepts(constraint.matcher, tokenizer, '{"z": "ab"}') and accepts(constraint.matcher, tokenizer, "{}")
    assert accepts(constraint.matcher, tokenizer, '{"z": "ab", "y": 1}')
    assert not accepts(constraint.matcher, tokenizer, '{"z": "ab", "q": 1}')


def test_anthropic_structured_outputs_close_objects_the_schema_leaves_open(tokenizer: Any) -> None:
    """Anthropic's SDK closes every object of an `output_config.format` schema (`transform_schema`) and its API
    refuses open ones: a schema sent raw without `additionalProperties` let the model add keys. Now closed, nested
    objects too, and a property left out of `required` still optional."""
    from http_frontend.anthropic.request import parse_output_format

    schema = {"type": "object", "properties": {"z": {"type": "string", "maxLength": 3},
                                               "o": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    response_format = parse_output_format({"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    constraint = constraint_for(tokenizer, response_format, None, None, None, False)
    assert accepts(constraint.matcher, tokenizer, '{"z": "ab"}') and accepts(constraint.matcher, tokenizer, "{}")
    assert accepts(constraint.matcher, tokenizer, '{"o": {"a": 1}}')
    assert not accepts(constraint.matcher, tokenizer, '{"z": "ab", "q": 1}')
    assert not accepts(constraint.matcher, tokenizer, '{"o": {"a": 1, "b": 2}}')
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["o"]


def test_strict_leaves_free_form_objects_and_all_of_compositions_open(tokenizer: Any) -> None:
    """A field typed only `object` (tools' free-form `meta`, MCP schemas) stays free-form, and an object whose keys
    `allOf` spreads over branches compiles (closing each part refused the others' keys: unsatisfiable, a 400)."""
    free = {"type": "object", "properties": {"meta": {"type": "object"}, "n": {"type": ["object", "null"]}}}
    constraint = constraint_for(tokenizer, json_schema_format(free, True), None, None, None, False)
    assert accepts(constraint.matcher, tokenizer, '{"meta": {"k": 1}, "n": {"j": 2}}')
    assert not accepts(constraint.matcher, tokenizer, '{"meta": {}, "n": null, "extra": 1}')
    composed = {"type": "object", "properties": {"a": {"type": "integer"}},
                "allOf": [{"properties": {"b": {"type": "integer"}}}]}
    constraint = constraint_for(tokenizer, json_schema_format(composed, True), None, None, None, False)
    assert accepts(constraint.matcher, tokenizer, '{"a": 1, "b": 2}')


def test_anthropic_strict_tools_close_objects_and_keep_properties_left_out_of_required_optional(
        tokenizer: Any) -> None:
    """Anthropic's `strict: true` on a tool was dropped by the front-end: a forced call could add keys the schema
    never named. Now its objects are closed, and, as Anthropic documents (not OpenAI's strict), a property the
    schema leaves out of `required` may still be left out; a `required` the schema writes holds."""
    from http_frontend.anthropic.tools import parse_anthropic_tool_choice, parse_anthropic_tools

    def forced(schema: dict[str, Any], strict: bool | None = True) -> GrammarConstraint:
        tool: dict[str, Any] = {"name": "f", "input_schema": schema, **({} if strict is None else {"strict": strict})}
        body = {"tools": [tool], "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True}}
        tools = parse_anthropic_tools(body)
        choice, parallel = parse_anthropic_tool_choice(body, tools)
        return constraint_for(tokenizer, None, tools, choice, parallel, False)

    def called(constraint: GrammarConstraint, arguments: str) -> bool:
        matcher = constraint.matcher.deep_copy()
        assert matcher.consume_token(tokenizer.tool_call_start_tokens[0])
        return accepts(matcher, tokenizer, f'\n{{"name": "f", "arguments": {arguments}}}\n',
                       then=tuple(tokenizer.tool_call_end_tokens))

    strict = forced(LOOSE)
    assert called(strict, '{"z": "ab"}') and called(strict, "{}")  # `z` is optional: no `required` lists it
    assert not called(strict, '{"z": "ab", "q": 1}')  # closed: a key the schema never named
    assert not called(strict, '{"z": "abcd"}')  # the schema's own constraints hold
    assert called(forced(LOOSE, strict=False), '{"z": "ab", "q": 1}')  # not strict: what JSON Schema allows
    nested = {"type": "object", "properties": {"o": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["a"]}, "n": {"type": "integer"}},
              "required": ["o"], "additionalProperties": False}
    constraint = forced(nested)
    assert called(constraint, '{"o": {"a": 1}}') and called(constraint, '{"o": {"a": 1}, "n": 2}')
    assert not called(constraint, '{"n": 2}') and not called(constraint, '{"o": {}}')
    assert not called(constraint, '{"o": {"a": 1, "b": 2}}')  # a nested object is closed too
