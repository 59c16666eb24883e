"""API keys, CORS and request limits through a real gunicorn front-end and a real engine."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Engine, Frontend

KEY = "sk-test-primary"
SECOND_KEY = "sk-test-second"
ALLOWED_ORIGIN = "https://app.example.com"
MAX_BODY_BYTES = 4096
MAX_MESSAGES = 4
MAX_TOKENS_LIMIT = 16


@pytest.fixture(scope="module")
def secured(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    logs = tmp_path_factory.mktemp("security")
    proc = Frontend(engine.endpoint, logs / "frontend.log", workers=1, args=[
        "--api-key", KEY, "--api-key", SECOND_KEY, "--allowed-origins", f"{ALLOWED_ORIGIN},https://other.example",
        "--max-body-bytes", str(MAX_BODY_BYTES), "--max-messages", str(MAX_MESSAGES),
        "--max-tokens-limit", str(MAX_TOKENS_LIMIT)])
    try:
        proc.wait_healthy()  # /health is public: no key needed
        yield proc
    finally:
        proc.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(model: str, messages: int = 1, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": f"hello {i}"} for i in range(messages)],
            "max_tokens": 4, "temperature": 0, **extra}


def assert_openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param and error["message"]
    return error


# -- API keys -----------------------------------------------------------------------------
def test_missing_key_is_401_in_openai_shape(secured: Frontend) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/stats"),
                         ("GET", "/metrics"), ("POST", "/unload"), ("GET", "/no-such-route")):
        response = httpx.request(method, f"{secured.base_url}{path}", timeout=10)
        error = assert_openai_error(response, 401, "invalid_api_key")
        assert error["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"


def test_wrong_key_is_401(secured: Frontend) -> None:
    for headers in (auth("sk-wrong"), {"x-api-key": "sk-wrong"}, auth(KEY + "x"), auth(KEY[:-1]),
                    {"Authorization": KEY}):  # no scheme
        response = httpx.get(f"{secured.base_url}/v1/models", headers=headers, timeout=10)
        assert_openai_error(response, 401, "invalid_api_key")
        assert KEY not in response.text


def test_right_key_via_bearer_or_x_api_key(secured: Frontend, model_id: str) -> None:
    for headers in (auth(KEY), auth(SECOND_KEY), {"x-api-key": KEY}, {"X-API-Key": SECOND_KEY},
                    {"Authorization": f"bearer {KEY}"}):
        response = httpx.get(f"{secured.base_url}/v1/models", headers=headers, timeout=30)
        assert response.status_code == 200, (headers, response.text)
        assert response.json()["object"] == "list"
    response = httpx.post(f"{secured.base_url}/v1/chat/completions", headers={"x-api-key": KEY},
                          json=chat_body(model_id), timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def test_health_is_public(secured: Frontend) -> None:
    response = httpx.get(f"{secured.base_url}/health", timeout=10)
    assert response.status_code == 200 and response.json()["status"] == "healthy"
    # Red team: without a key it named the model's server path, the engine's endpoint and its pid.
    assert response.json() == {"status": "healthy"}
    full = httpx.get(f"{secured.base_url}/health", headers=auth(), timeout=10).json()
    assert full["status"] == "healthy" and full["loaded_model"] and full["engine"]["pid"]
    # Load balancers probe with HEAD too (it was a 405): the same status, no body.
    head = httpx.head(f"{secured.base_url}/health", timeout=10)
    assert head.status_code == 200 and not head.content
    # ...but only GET and HEAD: the public exception is not a prefix or a method wildcard.
    assert httpx.post(f"{secured.base_url}/health", timeout=10).status_code == 401
    assert httpx.get(f"{secured.base_url}/health/x", timeout=10).status_code == 401


def test_a_key_sent_as_basic_auth_is_not_logged(secured: Frontend) -> None:
    """Red team: `curl -u sk-...:` put the key in gunicorn's access line (its Basic-auth user field), and so did
    a key in the query string (the request line)."""
    for path in ("/stats", "/health"):
        httpx.get(f"{secured.base_url}{path}", auth=(SECOND_KEY, ""), timeout=10)
    httpx.get(f"{secured.base_url}/stats?api_key={SECOND_KEY}", timeout=10)  # refused, and not logged either
    httpx.get(f"{secured.base_url}/health", timeout=10)  # a line after them: theirs are flushed
    log = secured.log()
    assert '"GET /stats HTTP/1.1" 401' in log
    assert SECOND_KEY not in log


def test_openai_sdk_with_right_and_wrong_key(secured: Frontend, model_id: str) -> None:
    good = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    reply = good.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(good.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in good.models.list()]

    bad = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_keys_from_the_environment(engine: Engine, model_id: str, tmp_path: Path) -> None:
    """MLX_ENGINE_API_KEY holds several comma-separated keys; a worker inherits it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_ENGINE_API_KEY", "env-key-one, env-key-two")
        proc = Frontend(engine.endpoint, tmp_path / "frontend.log", workers=1)
    try:
        proc.wait_healthy()
        url = f"{proc.base_url}/v1/models"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers=auth("env-key-one"), timeout=30).status_code == 200
        assert httpx.get(url, headers={"x-api-key": "env-key-two"}, timeout=30).status_code == 200
        assert httpx.get(url, headers=auth("env-key-one, env-key-two"), timeout=10).status_code == 401
    finally:
        proc.stop()
    assert "env-key-one" not in proc.log()  # keys never reach the logs


def test_no_key_configured_means_open(frontend: Frontend) -> None:
    """The shared front-end has no key: the SDK's placeholder key is simply ignored."""
    assert httpx.get(f"{frontend.base_url}/v1/models", timeout=30).status_code == 200


# -- CORS ---------------------------------------------------------------------------------
def test_cors_allowed_origin_gets_the_header(secured: Frontend) -> None:
    response = httpx.get(f"{secured.base_url}/v1/models", headers={**auth(), "Origin": ALLOWED_ORIGIN}, timeout=30)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "access-control-allow-credentials" not in response.headers
    # A 401 is readable by the allowed page too, so it can tell its user the key is wrong.
    response = httpx.get(f"{secured.base_url}/v1/models", headers={"Origin": ALLOWED_ORIGIN}, timeout=10)
    assert response.status_code == 401
    assert response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_cors_disallowed_origin_gets_no_header(secured: Frontend, frontend: Frontend) -> None:
    for origin in ("https://evil.example", "https://app.example.com.evil.example", "null"):
        response = httpx.get(f"{secured.base_url}/v1/models", headers={**auth(), "Origin": origin}, timeout=30)
        assert response.status_code == 200
        assert not any(h.startswith("access-control-") for h in response.headers), response.headers
    # Without --allowed-origins there are no CORS headers at all.
    response = httpx.get(f"{frontend.base_url}/health", headers={"Origin": ALLOWED_ORIGIN}, timeout=10)
    assert "access-control-allow-origin" not in response.headers


def test_cors_preflight_needs_no_key(secured: Frontend) -> None:
    headers = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
    response = httpx.options(f"{secured.base_url}/v1/chat/completions", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    # A plain OPTIONS (not a preflight) is no way around the key.
    assert httpx.options(f"{secured.base_url}/v1/chat/completions", timeout=10).status_code == 401


# -- limits -------------------------------------------------------------------------------
def test_oversized_body_is_413(secured: Frontend, model_id: str) -> None:
    body = chat_body(model_id)
    body["messages"][0]["content"] = "x" * MAX_BODY_BYTES
    response = httpx.post(f"{secured.base_url}/v1/chat/completions", headers=auth(), json=body, timeout=30)
    error = assert_openai_error(response, 413, "request_too_large")
    assert error["type"] == "invalid_request_error" and str(MAX_BODY_BYTES) in error["message"]

    # Chunked (no Content-Length): refused after reading one byte past the limit, not buffered whole.
    raw = json.dumps(body).encode()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(raw), 1000):
            yield raw[start:start + 1000]

    response = httpx.post(f"{secured.base_url}/v1/chat/completions", headers={**auth(), "content-type":
                          "application/json"}, content=chunks(), timeout=30)
    assert_openai_error(response, 413, "request_too_large")

    # Just under the limit is fine.
    body["messages"][0]["content"] = "x" * (MAX_BODY_BYTES // 2)
    response = httpx.post(f"{secured.base_url}/v1/chat/completions", headers=auth(), json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_too_many_messages_is_400(secured: Frontend, model_id: str) -> None:
    response = httpx.post(f"{secured.base_url}/v1/chat/completions", headers=auth(),
                          json=chat_body(model_id, messages=MAX_MESSAGES + 1), timeout=30)
    error = assert_openai_error(response, 400, "array_above_max_length", param="messages")
    assert f"maximum length {MAX_MESSAGES}" in error["message"]
    response = httpx.post(f"{secured.base_url}/v1/chat/completions", headers=auth(),
                          json=chat_body(model_id, messages=MAX_MESSAGES), timeout=60)
    assert response.status_code == 200, response.text


def test_max_tokens_over_the_ceiling_is_400(secured: Frontend, model_id: str) -> None:
    url = f"{secured.base_url}/v1/chat/completions"
    response = httpx.post(url, headers=auth(), json=chat_body(model_id, max_tokens=MAX_TOKENS_LIMIT + 1), timeout=30)
    error = assert_openai_error(response, 400, "max_tokens_exceeded", param="max_tokens")
    assert str(MAX_TOKENS_LIMIT) in error["message"]
    body = chat_body(model_id, max_completion_tokens=MAX_TOKENS_LIMIT * 10)
    del body["max_tokens"]
    response = httpx.post(url, headers=auth(), json=body, timeout=30)
    assert_openai_error(response, 400, "max_tokens_exceeded", param="max_completion_tokens")

    client = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=MAX_TOKENS_LIMIT + 1, stream=True)
    assert caught.value.code == "max_tokens_exceeded"
    reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=MAX_TOKENS_LIMIT, temperature=0)
    assert reply.usage.completion_tokens <= MAX_TOKENS_LIMIT


def test_bad_limit_flag_is_refused_at_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "http_frontend.cli", "--max-body-bytes", "lots"],
                            capture_output=True, text=True, timeout=30, env=dict(os.environ))
    assert result.returncode == 2 and "--max-body-bytes" in result.stderr
