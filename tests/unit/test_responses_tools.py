"""Agents' Responses tools and replayed items, through the app with a fake engine (falcon.testing).

The shapes are Codex CLI 0.169's: `namespace`, `custom` (Lark / regex grammars) and hosted
tools, tools in an `additional_tools` input item, replayed `custom_tool_call`,
`local_shell_call`, `web_search_call`, `compaction` items, and `tool_choice` objects.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.fake_engine import FakeEngine, client_for, say, sse_events, usage

NAMESPACE = {"type": "namespace", "name": "clock", "description": "", "tools": [
    {"type": "function", "name": "sleep", "parameters": {"type": "object", "properties": {"ms": {"type": "number"}}}},
    {"type": "custom", "name": "exec", "description": "Runs code",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[a-z ]+/"}}]}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "tool_search", "execution": "client"},
          {"type": "web_search_preview"}, {"type": "image_generation"}, {"type": "mcp", "server_label": "x"}]


def calls_of(*calls: tuple[str, str]) -> list[dict[str, Any]]:
    """DELTAS items: the engine's tool calls (offered name, arguments), then the finish."""
    return [{"tool_calls": [{"id": f"call_{i}", "name": name, "arguments": arguments}
                            for i, (name, arguments) in enumerate(calls)]},
            {"finish_reason": "tool_calls", "usage": usage(4)}]


def post(engine: FakeEngine, **body: Any):
    return client_for(engine).simulate_post("/v1/responses", json={"model": "m", **body})


def test_namespace_tools_are_flattened_and_their_calls_name_the_namespace() -> None:
    engine = FakeEngine(script=lambda request: calls_of(("sleep", '{"ms": 1}')))
    result = post(engine, input="hi", tools=[NAMESPACE, *HOSTED])
    assert result.status_code == 200, result.text
    offered = engine.added[-1]["tools"]
    assert [t["function"]["name"] for t in offered] == ["sleep", "exec"]
    assert offered[1]["function"]["parameters"]["properties"]["input"]["type"] == "string"
    assert offered[1]["function"]["parameters"]["properties"]["input"]["x-lark"] == "start: /[a-z ]+/"
    (call,) = result.json["output"]
    assert (call["type"], call["name"], call["namespace"], call["arguments"]) == (
        "function_call", "sleep", "clock", '{"ms": 1}')
    # Hosted tools are left out of the prompt and named in a header, never a 400.
    assert result.headers["X-Ignored-Tools"] == "web_search,tool_search,web_search_preview,image_generation,mcp"


def test_a_custom_tool_call_comes_back_with_its_raw_input_streamed_and_not() -> None:
    engine = FakeEngine(script=lambda request: calls_of(("exec", json.dumps({"input": "print hi\nexit"}))))
    result = post(engine, input="hi", tools=[NAMESPACE])
    (call,) = result.json["output"]
    assert (call["type"], call["name"], call["namespace"], call["input"]) == (
        "custom_tool_call", "exec", "clock", "print hi\nexit")
    assert "_offered" not in call and "arguments" not in call
    streamed = post(engine, input="hi", tools=[NAMESPACE], stream=True)
    events = [(name, json.loads(data)) for name, data in sse_events(streamed.text)]
    names = [name for name, _ in events]
    assert "response.custom_tool_call_input.delta" in names and "response.custom_tool_call_input.done" in names
    done = next(data for name, data in events if name == "response.output_item.done")
    assert done["item"]["type"] == "custom_tool_call" and done["item"]["input"] == "print hi\nexit"
    assert not any(key.startswith("_") for key in done["item"])


def test_a_regex_grammar_becomes_the_input_pattern() -> None:
    engine = FakeEngine()
    tool = {"type": "custom", "name": "pick", "format": {"type": "grammar", "syntax": "regex", "definition": "a|b"}}
    assert post(engine, input="hi", tools=[tool], tool_choice={"type": "custom", "name": "pick"}).status_code == 200
    (offered,) = engine.added[-1]["tools"]
    assert offered["function"]["parameters"]["properties"]["input"]["pattern"] == "^(?:a|b)$"
    assert engine.added[-1]["tool_choice"] == {"type": "function", "function": {"name": "pick"}}


def test_tools_in_an_additional_tools_item_and_replayed_codex_items() -> None:
    engine = FakeEngine()
    replay = [
        {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [NAMESPACE, HOSTED[0]]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "function_call", "name": "sleep", "namespace": "clock", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sleep completed."},
        {"type": "custom_tool_call", "name": "exec", "namespace": "clock", "input": "ls", "call_id": "c2",
         "status": "completed"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "file.txt"},
        {"type": "local_shell_call", "call_id": "c3", "status": "completed",
         "action": {"type": "exec", "command": ["ls"]}},
        {"type": "local_shell_call_output", "call_id": "c3", "output": "ok"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "x"}},
        {"type": "compaction", "encrypted_content": "opaque"},
        {"type": "compaction_summary", "encrypted_content": "opaque"},
    ]
    result = post(engine, input=replay, tool_choice={"type": "required"})
    assert result.status_code == 200, result.text
    sent = engine.added[-1]
    assert [t["function"]["name"] for t in sent["tools"]] == ["sleep", "exec"] and sent["tool_choice"] == "required"
    messages = sent["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant",
                                             "tool"]
    assert messages[2]["tool_calls"][0]["function"]["name"] == "sleep"
    assert json.loads(messages[4]["tool_calls"][0]["function"]["arguments"]) == {"input": "ls"}
    assert messages[6]["tool_calls"][0]["function"]["name"] == "local_shell"
    assert result.headers["X-Ignored-Tools"] == "web_search"


def test_a_name_two_namespaces_share_is_offered_qualified() -> None:
    engine = FakeEngine(script=lambda request: calls_of(("b.wait", "{}")))
    tools = [{"type": "namespace", "name": ns, "tools": [{"type": "function", "name": "wait"}]} for ns in "ab"]
    result = post(engine, input="hi", tools=tools)
    assert [t["function"]["name"] for t in engine.added[-1]["tools"]] == ["a.wait", "b.wait"]
    (call,) = result.json["output"]
    assert (call["name"], call["namespace"]) == ("wait", "b")


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "required"}, "required"), ({"type": "any"}, "required"), ({"type": "auto"}, "auto"),
    ({"type": "none"}, "none"),
    ({"type": "allowed_tools", "mode": "required",
      "tools": [{"type": "function", "name": "sleep", "namespace": "clock"}]},
     {"type": "allowed_tools", "mode": "required", "tools": ["sleep"]}),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}, "auto"),
    ({"type": "web_search_preview"}, "auto"), ({"type": "function", "name": "sleep"},
                                               {"type": "function", "function": {"name": "sleep"}}),
])
def test_tool_choice_objects_on_responses(choice: dict[str, Any], expected: Any) -> None:
    engine = FakeEngine()
    assert post(engine, input="hi", tools=[NAMESPACE], tool_choice=choice).status_code == 200
    assert engine.added[-1]["tool_choice"] == expected


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "required"}, "required"), ({"type": "any"}, "required"), ({"type": "auto"}, "auto"),
])
def test_tool_choice_objects_on_chat(choice: dict[str, Any], expected: str) -> None:
    engine = FakeEngine(script=lambda request: say("ok"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    result = client_for(engine).simulate_post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice})
    assert result.status_code == 200, result.text
    assert engine.added[-1]["tool_choice"] == expected


def test_unknown_tool_and_item_types_are_still_refused_clearly() -> None:
    engine = FakeEngine()
    result = post(engine, input="hi", tools=[{"type": "teleport"}])
    assert result.status_code == 400 and result.json["error"]["param"] == "tools[0]"
    result = post(engine, input=[{"type": "teleport_call"}])
    assert result.status_code == 400 and result.json["error"]["param"] == "input[0].type"


def test_hosted_tools_on_chat_are_left_out_and_named() -> None:
    engine = FakeEngine(script=lambda request: say("ok"))
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "web_search_preview"},
             {"type": "web_search_20250305", "name": "web_search"}]
    result = client_for(engine).simulate_post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert result.status_code == 200, result.text
    assert [t["function"]["name"] for t in engine.added[-1]["tools"]] == ["f"]
    assert result.headers["X-Ignored-Tools"] == "web_search_preview,web_search"


# Codex CLI's apply_patch grammar (codex-rs tool_apply_patch.lark), the custom tool it sends most.
APPLY_PATCH = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
%import common.LF
'''


def test_a_lark_grammar_holds_through_json_escaping() -> None:
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from engine_daemon.sampling.custom_grammar import input_rule
    from model_builders.tokenizer import train_tokenizer_json

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(train_tokenizer_json(2048)),
                                        eos_token="<|im_end|>")
    vocabulary = from_tokenizer(tokenizer)
    rule = input_rule(APPLY_PATCH)
    assert rule is not None

    def accepts(text: str) -> bool:
        matcher = LLMatcher(vocabulary, LLMatcher.grammar_from_lark(f"start: {rule}\n"), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    patch = '*** Begin Patch\n*** Update File: a "b".py\n@@ def f():\n-  x = "\\t"\x1b\n+  x = "\ty"\n*** End Patch\n'
    assert accepts(json.dumps({"input": patch}))
    assert not accepts(json.dumps({"input": patch.replace("*** End Patch", "*** Fin")}))
    assert not accepts('{"input": "*** Begin Patch\n*** Add File: x\\n+hi\\n*** End Patch"}')  # a raw newline
    # What the rewrite cannot carry is left to the JSON schema, never refused.
    assert input_rule('start: WORD\n%ignore " "\n%import common.WORD\n') is None
    assert input_rule("start: /^anchored/") is None


@pytest.mark.parametrize("definition", ['start: "\\ud800"', "start: /\\ud800/", "start: /[\\ud800]/"])
def test_a_grammar_naming_a_lone_surrogate_is_a_400_naming_the_tool(definition: str) -> None:
    from engine_daemon.errors import RequestError
    from engine_daemon.sampling.structured import function_specs, with_custom_grammars

    schema = {"type": "object", "properties": {"input": {"type": "string", "x-lark": definition}}}
    tools = [{"type": "function", "function": {"name": "c", "parameters": schema}}]
    with pytest.raises(RequestError) as refused:  # llguidance's UnicodeEncodeError before: the engine's 500
        with_custom_grammars(function_specs(tools))
    assert refused.value.status == 400 and refused.value.param == "tools[0].function.parameters"
    assert "surrogate" in str(refused.value)


def test_the_ignored_tools_header_is_visible_ascii_whatever_the_names() -> None:
    from http_frontend.parsing.generation_fields import ignored_tools_header

    value = ignored_tools_header(["web_search", "wéb, search\r\nX-Evil: 1", "web_search", "x" * 5000])
    assert value.isascii() and value.isprintable() and "\n" not in value
    assert value.startswith("web_search,w%C3%A9b%2C%20search%0D%0AX-Evil:%201,")
    assert len(value) <= 1024


def test_a_custom_calls_input_streams_decoded_as_its_arguments_are_written() -> None:
    """Codex's apply_patch is a custom tool: its patch streams as `custom_tool_call_input.delta` text while
    written (Codex gives up on a stream idle for 5 minutes), escapes split across pieces decoded whole."""
    from http_frontend.engine.client import Update
    from http_frontend.openai.responses_stream import ResponseBuilder
    from http_frontend.openai.responses_tools import ToolOrigin

    patch = '*** Begin Patch\n*** Update File: a.py\n-print("café")\n+print("caf\\u00e9 \\\\ done")\n*** End Patch'
    arguments = json.dumps({"input": patch}, ensure_ascii=True)
    cuts = [0, 3, 11, 30, arguments.index("\\u00e9") + 3, arguments.index("\\\\") + 1, len(arguments) - 5]
    builder = ResponseBuilder({"id": "resp_1", "model": "m"}, {"apply_patch": ToolOrigin("custom", "apply_patch")})
    events = []
    for number, (start, end) in enumerate(zip(cuts, cuts[1:])):
        piece = {"index": 0, "arguments": arguments[start:end]}
        if number == 0:
            piece |= {"id": "call_1", "name": "apply_patch"}
        events += builder.feed(Update(tool_parts=[("piece", piece)]))
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    assert len([e for e in events if e["type"] == "response.custom_tool_call_input.delta"]) >= 4
    assert patch.startswith(streamed) and len(streamed) > len(patch) - 10
    events += builder.feed(Update(tool_parts=[("call", {"index": 0, "id": "call_1", "name": "apply_patch",
                                                        "arguments": arguments})], finish_reason="tool_calls"))
    assert "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta") == patch
    (done,) = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    (item,) = builder.output
    assert done["input"] == item["input"] == patch and item["type"] == "custom_tool_call"
    assert [e["type"] for e in events][0] == "response.output_item.added"
