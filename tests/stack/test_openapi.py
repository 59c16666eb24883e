"""GET /openapi.json is served, covers every route, and is true of a live server (Schemathesis).

Schemathesis generates requests from the document (valid and invalid ones) and
sends them to a real engine + gunicorn front-end; every answer must be a non-5xx
with a documented status code, content type and body schema. The engine runs with
a tiny default max_tokens and the front-end with a low max_tokens ceiling so that
generated generation requests stay cheap.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from http_frontend.service.openapi import openapi_document
from tests.helpers import Engine, Frontend

SCHEMA = schemathesis.openapi.from_dict(openapi_document())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    logs = tmp_path_factory.mktemp("openapi-logs")
    engine = Engine(f"ipc://{ipc_dir}/openapi.sock", logs / "engined.log", model=str(tiny_model),
                    args=["--default-max-tokens", "4"])
    frontend = None
    try:
        engine.wait_ready()
        frontend = Frontend(engine.endpoint, logs / "frontend.log", workers=1,
                            args=["--max-tokens-limit", "8", "--image-fetch-timeout", "1"])
        frontend.wait_healthy()
        yield frontend
    finally:
        if frontend is not None:
            frontend.stop()
        engine.stop()


def test_document_is_served(api: Frontend) -> None:
    response = httpx.get(f"{api.base_url}/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.") and "/v1/chat/completions" in document["paths"]


@SCHEMA.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_live_server_matches_the_document(case: schemathesis.Case, api: Frontend) -> None:
    if case.path == "/unload":
        pytest.skip("unloading is covered by test_operations; here it would only slow every other case")
    case.call_and_validate(base_url=api.base_url, checks=CHECKS, timeout=60)


VALID_REQUESTS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2},
    "/v1/completions": {"prompt": "Once upon", "max_tokens": 4, "stream_options": {"include_usage": True}},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}


@pytest.mark.parametrize("path", sorted(VALID_REQUESTS))
@pytest.mark.parametrize("stream", [False, True])
def test_valid_requests_match_the_document(api: Frontend, path: str, stream: bool) -> None:
    """Generated cases are mostly invalid: these make sure real answers, streamed too, are checked."""
    case = SCHEMA[path]["POST"].Case(body={**VALID_REQUESTS[path], "stream": stream}, media_type="application/json")
    response = case.call_and_validate(base_url=api.base_url, checks=CHECKS, timeout=60)
    assert response.status_code == 200
    expected = "text/event-stream" if stream else "application/json"
    assert response.headers["content-type"][0].startswith(expected)
