"""Roles and shares between API keys, against the real engine + gunicorn front-end (isolation issue, 11 and 12)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, call_engine, running_stack
from tests.stack.test_isolation import order_of

USER_A, USER_B, ADMIN = "key-user-a", "key-user-b", "key-admin"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(tiny_model: Path, ipc_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Frontend]]:
    with running_stack(f"ipc://{ipc_dir}/roles.sock", tmp_path_factory.mktemp("roles"), model=str(tiny_model),
                       engine_args=["--decode-concurrency", "2"], env={"MLX_ENGINE_FAULT_INJECTION": "1"},
                       frontend_args=["--api-key", USER_A, "--api-key", USER_B, "--admin-api-key", ADMIN],
                       workers=2) as stack:
        yield stack


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/unload", None), ("POST", "/v1/adapters", {"name": "x", "path": "y"}),
    ("POST", "/adapters", {"name": "x", "path": "y"}), ("DELETE", "/v1/adapters/x", None),
    ("POST", "//unload", None), ("DELETE", "//v1/adapters/x", None)])  # falcon routes `//unload` to /unload too
def test_ordinary_keys_get_403_on_admin_routes(keyed: tuple[Engine, Frontend], method: str, path: str,
                                               body: dict | None) -> None:
    """Attack 11: any key could unload the model (ending every client's streams) or change adapters."""
    _, frontend = keyed
    response = httpx.request(method, f"{frontend.base_url}{path}", json=body, headers=auth(USER_A), timeout=30)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "admin_key_required" and error["type"] == "permission_error"
    assert httpx.request(method, f"{frontend.base_url}{path}", json=body, timeout=30).status_code == 401


def test_the_admin_key_unloads_and_works_everywhere(keyed: tuple[Engine, Frontend], model_id: str) -> None:
    engine, frontend = keyed
    chat = httpx.post(f"{frontend.base_url}/v1/chat/completions", headers=auth(ADMIN), timeout=60, json={
        "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200
    assert httpx.post(f"{frontend.base_url}/unload", headers=auth(ADMIN), timeout=60).json()["status"] == "success"
    again = httpx.post(f"{frontend.base_url}/v1/chat/completions", headers=auth(USER_A), timeout=60, json={
        "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert again.status_code == 200  # the next request loads the model again


def test_stored_responses_belong_to_the_key_that_made_them(keyed: tuple[Engine, Frontend], model_id: str) -> None:
    """Attack 11: any key could read or delete any other key's stored responses."""
    _, frontend = keyed
    base = f"{frontend.base_url}/v1/responses"
    created = httpx.post(base, headers=auth(USER_A), timeout=60,
                         json={"model": model_id, "input": "remember this", "max_output_tokens": 4}).json()
    rid = created["id"]
    assert httpx.get(f"{base}/{rid}", headers=auth(USER_A), timeout=30).status_code == 200
    for method, path in [("GET", f"{base}/{rid}"), ("GET", f"{base}/{rid}/input_items"),
                         ("POST", f"{base}/{rid}/cancel"), ("DELETE", f"{base}/{rid}")]:
        other = httpx.request(method, path, headers=auth(USER_B), timeout=30)
        assert other.status_code == 404 and other.json()["error"]["code"] == "response_not_found", (method, path)
    follow = httpx.post(base, headers=auth(USER_B), timeout=60, json={
        "model": model_id, "input": "go on", "previous_response_id": rid, "max_output_tokens": 4})
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"
    assert httpx.delete(f"{base}/{rid}", headers=auth(USER_A), timeout=30).json()["deleted"] is True


def test_decode_slots_are_shared_between_keys(keyed: tuple[Engine, Frontend], model_id: str) -> None:
    """Attack 12: key A's four long requests, then key B's one, while the engine is held so all queue
    together (--decode-concurrency 2): B gets a slot before A's last request does (the engine's log)."""
    engine, frontend = keyed
    ask = {"model": model_id, "messages": [{"role": "user", "content": "story"}], "max_tokens": 24,
           "temperature": 0, "ignore_eos": True}
    rids: dict[str, str] = {}

    def send(key: str, name: str) -> None:
        response = httpx.post(f"{frontend.base_url}/v1/chat/completions", headers=auth(key), json=ask, timeout=120)
        assert response.status_code == 200
        rids[name] = response.headers["x-request-id"]

    hold = threading.Thread(target=call_engine, args=(engine.endpoint, "debug_sleep", {"seconds": 3.0}))
    hold.start()
    time.sleep(0.3)  # the mlx thread is asleep: what follows queues up behind it
    threads = [threading.Thread(target=send, args=(USER_A, f"a{i}")) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # A's four are in the engine's queue before B's
    threads.append(threading.Thread(target=send, args=(USER_B, "b")))
    threads[-1].start()
    for thread in [hold, *threads]:
        thread.join(120)
    accepted = order_of(engine.log(), "accepted")
    a_last = max(accepted.index(rids[f"a{i}"]) for i in range(4))
    assert accepted.index(rids["b"]) < a_last, (accepted, rids)
