"""Anthropic's strict tool use (`strict: true` on a tool) through the app with a fake engine (falcon.testing).

The front-end dropped `strict`, so the engine never held a call to the tool's schema as strict promises.
Now it reaches the engine as the function's `strict` with Anthropic's meaning (`STRICT_CLOSED`: objects
closed, `required` as written), and a `strict` that is not a boolean is a 400 in Anthropic's envelope.
"""

from __future__ import annotations

from typing import Any

import pytest

from protocol.messages import STRICT_CLOSED
from tests.unit.fake_engine import FakeEngine, client_for

HELLO = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}


def post(engine: FakeEngine, **body: Any):
    return client_for(engine).simulate_post("/v1/messages", json={"model": "m", "max_tokens": 16, "messages": HELLO,
                                                                  **body})


def test_strict_reaches_the_engine_with_anthropics_meaning() -> None:
    engine = FakeEngine()
    tools = [{"name": "weather", "input_schema": SCHEMA, "strict": True},
             {"name": "loose", "input_schema": SCHEMA, "strict": False},
             {"name": "plain", "input_schema": SCHEMA},
             {"name": "later", "input_schema": SCHEMA, "strict": True, "defer_loading": True},
             {"type": "bash_20250124", "name": "bash", "strict": True}]
    result = post(engine, tools=tools, tool_choice={"type": "tool", "name": "weather"})
    assert result.status_code == 200, result.text
    sent = {tool["function"]["name"]: tool for tool in engine.added[-1]["tools"]}
    assert {name: tool["function"].get("strict") for name, tool in sent.items()} == {
        "weather": STRICT_CLOSED, "loose": None, "plain": None, "later": STRICT_CLOSED, "bash": STRICT_CLOSED}
    assert sent["weather"]["function"]["parameters"] == SCHEMA  # the schema the prompt shows is the client's
    assert sent["later"]["defer_loading"] is True
    assert engine.added[-1]["tool_choice"] == {"type": "function", "function": {"name": "weather"}}


@pytest.mark.parametrize("strict", ["true", 1, 0, {"enabled": True}])
def test_a_strict_that_is_not_a_boolean_is_a_400_in_anthropics_envelope(strict: Any) -> None:
    engine = FakeEngine()
    result = post(engine, tools=[{"name": "weather", "input_schema": SCHEMA, "strict": strict}])
    assert result.status_code == 400 and not engine.added
    assert result.json["type"] == "error" and result.json["error"]["type"] == "invalid_request_error"
    assert result.json["error"]["message"].startswith("tools.0.strict:"), result.json
    client_tool = post(engine, tools=[{"type": "bash_20250124", "name": "bash", "strict": "yes"}])
    assert client_tool.status_code == 400 and "tools.0.strict" in client_tool.json["error"]["message"]
