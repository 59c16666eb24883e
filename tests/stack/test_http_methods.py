"""HEAD and wrong methods through the real front-end (gunicorn -> engined): what probes and monitors send.

Uptime monitors and health checkers probe with HEAD; a 405 reads as "down". HEAD of a GET
route answers GET's status and headers without a body. A method a route does not serve is a
405 naming the methods it does serve (`Allow`), in the envelope of the route's API.
"""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import Frontend

GET_ROUTES = ["/v1/models", "/models", "/v1/adapters", "/health", "/stats", "/metrics", "/admin/engines",
              "/openapi.json"]


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_of_a_get_route_answers_like_get_without_a_body(frontend: Frontend, path: str) -> None:
    got = httpx.get(f"{frontend.base_url}{path}", timeout=30)
    head = httpx.head(f"{frontend.base_url}{path}", timeout=30)
    assert got.status_code == 200, got.text
    assert head.status_code == 200, (path, head.status_code, head.headers)
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


def test_head_of_one_model_and_of_an_unknown_one(frontend: Frontend, model_id: str) -> None:
    listed = httpx.get(f"{frontend.base_url}/v1/models", timeout=30).json()["data"]
    head = httpx.head(f"{frontend.base_url}/v1/models/{listed[0]['id']}", timeout=30)
    assert head.status_code == 200 and head.content == b""
    missing = httpx.head(f"{frontend.base_url}/v1/models/no-such-model", timeout=30)
    assert missing.status_code == 404 and missing.content == b""


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"])
def test_post_only_routes_refuse_head_and_get_with_405_and_allow(frontend: Frontend, path: str) -> None:
    """405 with `Allow` is HTTP's answer (RFC 9110 15.5.6); GET's body is the route's own error envelope."""
    head = httpx.head(f"{frontend.base_url}{path}", timeout=30)
    assert head.status_code == 405 and head.content == b""
    allowed = {m.strip() for m in head.headers["allow"].split(",")}
    assert "POST" in allowed and "HEAD" not in allowed and "GET" not in allowed
    got = httpx.get(f"{frontend.base_url}{path}", timeout=30)
    assert got.status_code == 405 and got.headers["allow"] == head.headers["allow"]
    body = got.json()
    if path == "/v1/messages":  # Anthropic's envelope on Anthropic's route
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == "invalid_request_error"
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "method_not_allowed"
    assert "GET" in body["error"]["message"] and path in body["error"]["message"]
