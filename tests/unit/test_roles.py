"""The admin role, stored-response ownership and the ADD's `client`, in-process (`create_app` around a
`FakeEngine`): who may call what, what the engine is told about the caller, and what it is never told.

The same behaviour against real processes: tests/stack/test_frontend_roles.py.
"""

from __future__ import annotations

import hashlib

import pytest

from http_frontend.settings import FrontendSettings
from protocol import CallMethod
from tests.unit.fake_engine import FakeEngine, client_for

USER_A, USER_B, ADMIN = "sk-user-a", "sk-user-b", "sk-admin"
KEYED = FrontendSettings(api_keys=(USER_A, USER_B), admin_api_keys=(ADMIN,))
ADMIN_CALLS = [("POST", "/unload", None), ("POST", "/v1/adapters", {"name": "x", "path": "y"}),
               ("POST", "/adapters", {"name": "x", "path": "y"}), ("DELETE", "/v1/adapters/x", None),
               ("DELETE", "/adapters/x", None)]
HELLO = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello"}]}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def simulate(client, method: str, path: str, body: dict | None, key: str | None):
    headers = bearer(key) if key else {}
    return client.simulate_request(method, path, json=body, headers=headers)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


# -- the admin role ---------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,body", ADMIN_CALLS)
def test_an_ordinary_key_gets_403_on_admin_routes_before_the_engine(engine: FakeEngine, method: str, path: str,
                                                                    body: dict | None) -> None:
    result = simulate(client_for(engine, KEYED), method, path, body, USER_A)
    assert result.status_code == 403, result.text
    assert set(result.json["error"]) == {"message", "type", "param", "code"}
    assert (result.json["error"]["type"], result.json["error"]["code"]) == ("permission_error", "admin_key_required")
    assert engine.calls == []  # refused before anything reached the engine


@pytest.mark.parametrize("method,path", [("POST", "//unload"), ("POST", "///unload"), ("POST", "//v1/adapters"),
                                         ("POST", "//adapters"), ("DELETE", "//v1/adapters/x")])
def test_admin_routes_spelled_otherwise_are_still_admin_routes(engine: FakeEngine, method: str, path: str) -> None:
    """The router sends `//unload` to the unload resource: the role is decided on the resource, not the path."""
    result = simulate(client_for(engine, KEYED), method, path, {"name": "x", "path": "y"}, USER_A)
    assert result.status_code in (403, 404), result.text
    assert engine.calls == []


@pytest.mark.parametrize("method,path,body", ADMIN_CALLS)
def test_the_admin_key_reaches_admin_routes(engine: FakeEngine, method: str, path: str, body: dict | None) -> None:
    result = simulate(client_for(engine, KEYED), method, path, body, ADMIN)
    assert result.status_code not in (401, 403), result.text
    assert engine.calls  # the engine was asked


@pytest.mark.parametrize("method,path,body", ADMIN_CALLS)
def test_without_a_key_admin_routes_are_401_not_403(engine: FakeEngine, method: str, path: str,
                                                    body: dict | None) -> None:
    result = simulate(client_for(engine, KEYED), method, path, body, None)
    assert result.status_code == 401 and result.json["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/v1/models", "/stats", "/v1/adapters", "/metrics"])
def test_the_admin_key_works_on_ordinary_routes(engine: FakeEngine, path: str) -> None:
    assert client_for(engine, KEYED).simulate_get(path, headers=bearer(ADMIN)).status_code == 200
    assert client_for(engine, KEYED).simulate_get(path, headers=bearer(USER_B)).status_code == 200


def test_the_admin_key_generates(engine: FakeEngine) -> None:
    result = client_for(engine, KEYED).simulate_post("/v1/chat/completions", json=HELLO, headers=bearer(ADMIN))
    assert result.status_code == 200, result.text


def test_with_keys_but_no_admin_key_nobody_may_unload(engine: FakeEngine) -> None:
    client = client_for(engine, FrontendSettings(api_keys=(USER_A,)))
    assert client.simulate_post("/unload", headers=bearer(USER_A)).status_code == 403
    assert client.simulate_get("/v1/models", headers=bearer(USER_A)).status_code == 200


def test_with_only_admin_keys_every_route_needs_one(engine: FakeEngine) -> None:
    client = client_for(engine, FrontendSettings(admin_api_keys=(ADMIN,)))
    assert client.simulate_get("/v1/models").status_code == 401
    assert client.simulate_get("/v1/models", headers=bearer(USER_A)).status_code == 401
    assert client.simulate_post("/unload", headers=bearer(ADMIN)).status_code == 200
    assert client.simulate_get("/health").status_code == 200  # probes stay public


def test_without_any_key_everything_stays_open(engine: FakeEngine) -> None:
    client = client_for(engine)
    assert client.simulate_post("/unload").status_code == 200
    assert client.simulate_post("/v1/adapters", json={"name": "x", "path": "y"}).status_code == 200


def test_the_admin_key_is_also_read_from_the_environment() -> None:
    settings = FrontendSettings.from_env({"MLX_FRONTEND_ADMIN_API_KEY": "sk-adm-1, sk-adm-2",
                                          "MLX_ENGINE_API_KEY": "sk-usr"})
    assert settings.admin_api_keys == ("sk-adm-1", "sk-adm-2") and settings.api_keys == ("sk-usr",)
    assert "sk-" not in repr(settings)  # never printed


# -- stored responses belong to their key -----------------------------------------------------
def stored_by(engine: FakeEngine, client, key: str | None) -> dict:
    """The record the front-end put into the engine's store for a Responses request made with `key`."""
    result = simulate(client, "POST", "/v1/responses", {"model": "fake-model", "input": "hi"}, key)
    assert result.status_code == 200, result.text
    puts = [args for method, args in engine.calls if method == CallMethod.RESPONSES_PUT.value]
    assert puts, engine.calls
    record = puts[-1]["record"] if "record" in puts[-1] else puts[-1]
    engine.replies[CallMethod.RESPONSES_GET] = record
    engine.replies[CallMethod.RESPONSES_DELETE] = {"deleted": True}
    return record


def test_the_record_holds_a_digest_of_the_key_never_the_key(engine: FakeEngine) -> None:
    client = client_for(engine, KEYED)
    record = stored_by(engine, client, USER_A)
    assert record["owner"] and record["owner"] != USER_A
    assert USER_A not in repr(engine.calls)
    assert record["owner"] in hashlib.sha256(USER_A.encode()).hexdigest()


@pytest.mark.parametrize("method,suffix", [("GET", ""), ("GET", "/input_items"), ("POST", "/cancel"),
                                           ("DELETE", "")])
def test_another_key_gets_404_on_a_stored_response(engine: FakeEngine, method: str, suffix: str) -> None:
    client = client_for(engine, KEYED)
    response_id = stored_by(engine, client, USER_A)["response"]["id"]
    other = simulate(client, method, f"/v1/responses/{response_id}{suffix}", None, USER_B)
    assert other.status_code == 404 and other.json["error"]["code"] == "response_not_found"
    assert CallMethod.RESPONSES_DELETE.value not in engine.methods_called()  # nothing deleted for the other key
    assert simulate(client, "GET", f"/v1/responses/{response_id}", None, USER_A).status_code == 200


def test_another_keys_response_cannot_be_continued(engine: FakeEngine) -> None:
    client = client_for(engine, KEYED)
    response_id = stored_by(engine, client, USER_A)["response"]["id"]
    follow = simulate(client, "POST", "/v1/responses",
                      {"model": "fake-model", "input": "go on", "previous_response_id": response_id}, USER_B)
    assert follow.status_code == 404 and follow.json["error"]["param"] == "previous_response_id"
    mine = simulate(client, "POST", "/v1/responses",
                    {"model": "fake-model", "input": "go on", "previous_response_id": response_id}, USER_A)
    assert mine.status_code == 200, mine.text


def test_the_owner_deletes_its_response(engine: FakeEngine) -> None:
    client = client_for(engine, KEYED)
    response_id = stored_by(engine, client, USER_A)["response"]["id"]
    deleted = simulate(client, "DELETE", f"/v1/responses/{response_id}", None, USER_A)
    assert deleted.status_code == 200 and deleted.json["deleted"] is True


def test_without_keys_stored_responses_stay_readable(engine: FakeEngine) -> None:
    client = client_for(engine)
    response_id = stored_by(engine, client, None)["response"]["id"]
    assert simulate(client, "GET", f"/v1/responses/{response_id}", None, None).status_code == 200


# -- the ADD's client: whose share of the decode slots ----------------------------------------
def test_the_add_names_the_key_digest_as_client(engine: FakeEngine) -> None:
    client = client_for(engine, KEYED)
    for key in (USER_A, USER_A, USER_B):
        assert simulate(client, "POST", "/v1/chat/completions", {**HELLO, "user": "alice"}, key).status_code == 200
    a1, a2, b = (added["client"] for added in engine.added)
    assert a1 == a2 != b  # one key, one client; the key wins over `user`
    assert USER_A not in a1 and "alice" not in a1 and len(a1) <= 64


def test_every_choice_of_n_counts_for_the_same_client(engine: FakeEngine) -> None:
    client = client_for(engine, KEYED)
    assert simulate(client, "POST", "/v1/chat/completions", {**HELLO, "n": 3}, USER_A).status_code == 200
    assert len(engine.added) == 3 and len({added["client"] for added in engine.added}) == 1


@pytest.mark.parametrize("path,body,expected", [
    ("/v1/chat/completions", {**HELLO, "user": "alice"}, "alice"),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "user": "bob"}, "bob"),
    ("/v1/messages", {"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                      "metadata": {"user_id": "carol"}}, "carol"),
    ("/v1/chat/completions", HELLO, None),
])
def test_without_keys_the_client_is_the_requests_user(engine: FakeEngine, path: str, body: dict,
                                                      expected: str | None) -> None:
    result = client_for(engine).simulate_post(path, json=body)
    assert result.status_code == 200, result.text
    assert engine.added[-1].get("client") == expected


def test_responses_requests_name_their_client_too(engine: FakeEngine) -> None:
    client = client_for(engine, KEYED)
    record = stored_by(engine, client, USER_A)
    assert engine.added[-1]["client"] == record["owner"]  # the store's owner and the slot share: one digest
