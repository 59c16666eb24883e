"""The official OpenAI JS SDK (npm `openai`, pinned in tests/clients/js/package-lock.json) against the real stack.

tests/clients/js/sdk_checks.mjs runs every check once against the session front-end and prints
what the SDK returned as one JSON object; the tests below assert on it. The SDK is
used unmodified: its own parsing (`chat.completions.parse`, the stream helpers, the
error classes) must accept what the server sends. Skipped when node or npm is not
installed; a failing `npm ci` is a failure, not a skip.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.helpers import Frontend
from tests.unit.test_responses_translation import collapse

log = logging.getLogger(__name__)

JS_DIR = Path(__file__).parent / "js"
NODE = shutil.which("node")
NPM = shutil.which("npm")

pytestmark = pytest.mark.skipif(NODE is None or NPM is None,
                                reason="node and npm are needed to run the OpenAI JS SDK (tests/clients/js)")

TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _installed_matches_lockfile() -> bool:
    """Whether node_modules holds exactly what package-lock.json pins (npm's hidden lockfile says so)."""
    hidden = JS_DIR / "node_modules" / ".package-lock.json"
    if not hidden.exists():
        return False
    pinned = json.loads((JS_DIR / "package-lock.json").read_text())["packages"]
    installed = json.loads(hidden.read_text())["packages"]
    return {k: v for k, v in pinned.items() if k} == installed


@pytest.fixture(scope="session")
def js_sdk() -> Path:
    """tests/clients/js with its node_modules installed from the committed lockfile (once; reused while it matches)."""
    if not _installed_matches_lockfile():
        # `npm ci` installs the lockfile's exact versions; skipping it when they are already there
        # keeps repeated runs offline and avoids racing another run's install.
        done = subprocess.run([NPM, "ci", "--no-audit", "--no-fund", "--prefer-offline"], cwd=JS_DIR,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"npm ci failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return JS_DIR


@pytest.fixture(scope="module")
def results(js_sdk: Path, frontend: Frontend, model_id: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(MLXE_BASE_URL=f"{frontend.base_url}/v1", MLXE_MODEL=model_id)
    done = subprocess.run([NODE, "sdk_checks.mjs"], cwd=js_sdk, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"node exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    log.info("JS SDK check timings (ms): %s", {name: check.get("ms") for name, check in out.items()})
    return out


def check(results: dict[str, Any], name: str) -> dict[str, Any]:
    result = results[name]
    assert "error" not in result, f"{name} threw in the JS SDK:\n{result['error']}"
    return result


def test_chat_create_and_for_await_stream_agree(results: dict[str, Any]) -> None:
    chat = check(results, "chat")
    assert chat["object"] == "chat.completion" and chat["role"] == "assistant"
    assert chat["text"] and chat["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 12
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + 12
    # Greedy: the streamed text is the non-streamed text, in chunks of one id and the chunk object type.
    assert chat["stream_text"] == chat["text"]
    assert chat["stream_objects"] == ["chat.completion.chunk"] and chat["stream_ids"] == 1
    assert chat["stream_first_role"] == "assistant" and chat["stream_finish_reasons"] == ["length"]
    # stream_options.include_usage: one final chunk with no choices carries the usage.
    assert chat["stream_usage_only_on_last"] and chat["stream_last_choices"] == 0
    usage = chat["stream_last_usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == \
        (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])


def test_chat_stream_helper_assembles_the_completion(results: dict[str, Any]) -> None:
    helper = check(results, "chat_stream_helper")
    assert helper["deltas"] == helper["final_text"] == results["chat"]["text"]
    assert helper["finish_reason"] == "length"


def test_forced_tool_call_is_parsed_by_the_sdk(results: dict[str, Any]) -> None:
    tool = check(results, "tool_call")
    assert tool["finish_reason"] == "tool_calls" and not tool["content"]
    (call,) = tool["calls"]
    assert call["type"] == "function" and call["name"] == "get_weather" and call["id"].startswith("call_")
    args = call["parsed_arguments"]
    assert args == json.loads(call["arguments"])
    assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F")
    assert isinstance(args["city"], str) and len(args["city"]) <= 16
    # Streamed through the SDK's helper: the same call, assembled from deltas and parsed.
    assert tool["stream_finish_reason"] == "tool_calls"
    assert tool["stream_calls"] == [{k: call[k] for k in ("name", "arguments", "parsed_arguments")}]
    assert tool["stream_parsed_arguments"] == [args]


def test_json_schema_response_format_is_parsed_by_the_sdk(results: dict[str, Any]) -> None:
    structured = check(results, "json_schema")
    assert structured["finish_reason"] == "stop"
    parsed = structured["parsed"]
    assert parsed == json.loads(structured["content"])
    jsonschema.validate(parsed, structured["schema"])
    assert set(parsed) == {"color", "count", "nick"}


def test_responses_create_and_stream(results: dict[str, Any]) -> None:
    responses = check(results, "responses")
    assert responses["object"] == "response" and responses["id"].startswith("resp_")
    assert responses["status"] == "incomplete" and responses["incomplete_reason"] == "max_output_tokens"
    assert responses["output_types"] == ["message"] and responses["output_text"]
    assert responses["usage"]["output_tokens"] == 8
    assert responses["usage"]["total_tokens"] == responses["usage"]["input_tokens"] + 8
    types = responses["event_types"]
    assert collapse(types) == ["response.created", "response.in_progress", *TEXT_EVENTS, "response.incomplete"]
    assert responses["sequence_numbers"] == list(range(len(types)))
    assert responses["stream_text"] == responses["stream_final_text"] == responses["output_text"]
    assert responses["stream_final_status"] == "incomplete"
    assert responses["stream_final_usage"]["output_tokens"] == 8
    # The SDK's responses.stream helper accumulates the same events into the final response.
    assert responses["helper_text"] == responses["helper_final_text"] == responses["output_text"]
    assert responses["helper_final_status"] == "incomplete"


def test_bad_parameter_throws_bad_request_error(results: dict[str, Any]) -> None:
    chat_error, responses_error = check(results, "bad_request")["caught"]
    for error, param in ((chat_error, "temperature"), (responses_error, "max_output_tokens")):
        assert error["thrown"], param
        assert error["class"] == "BadRequestError" and error["is_bad_request"] and error["is_api_error"], error
        assert error["status"] == 400 and error["param"] == param, error
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value", error
        assert param in error["message"]
