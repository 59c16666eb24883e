"""The service routes in-process (models, health, stats, tokenize, adapters, metrics) around a `FakeEngine`."""

from __future__ import annotations

import pytest

from protocol import CallMethod
from tests.unit.fake_engine import MODEL, FakeEngine, client_for


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


def test_models_list_and_one_model_by_an_id_with_a_slash(engine: FakeEngine) -> None:
    client = client_for(engine)
    listed = client.simulate_get("/v1/models").json
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [MODEL, "org/other-model"]
    first = listed["data"][0]
    assert first == {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "local",
                     "context_window": 4096, "type": "text", "kind": "text", "loaded": True}
    other = client.simulate_get("/v1/models/org/other-model").json
    assert (other["id"], other["kind"], other["loaded"]) == ("org/other-model", "vision", False)
    missing = client.simulate_get("/v1/models/nope")
    assert missing.status_code == 404
    assert (missing.json["error"]["code"], missing.json["error"]["param"]) == ("model_not_found", "model")


def test_health_healthy_stalled_and_down(engine: FakeEngine) -> None:
    client = client_for(engine)
    healthy = client.simulate_get("/health")
    assert healthy.status_code == 200
    assert (healthy.json["status"], healthy.json["loaded_model"], healthy.json["engine"]["epoch"]) == \
        ("healthy", MODEL, 1)
    engine.replies[CallMethod.STATUS] = {**engine.replies[CallMethod.STATUS], "state": "stalled"}
    stalled = client.simulate_get("/health")
    assert (stalled.status_code, stalled.json["status"], stalled.headers["retry-after"]) == (503, "stalled", "5")
    engine.up = False
    down = client.simulate_get("/health")
    assert (down.status_code, down.json["status"], down.headers["retry-after"]) == (503, "unhealthy", "1")
    assert down.json["loaded_model"] is None


def test_stats_add_this_workers_figures_and_unload_is_a_call(engine: FakeEngine) -> None:
    client = client_for(engine)
    stats = client.simulate_get("/stats").json
    assert stats["tokens_generated"] == 12 and stats["frontend"] == {"id": "fake-frontend", "open_streams": 0}
    assert client.simulate_post("/unload").json == {"status": "success"}
    assert engine.methods_called() == ["stats", "unload"]


def test_an_engine_refusing_a_call_answers_its_own_error(engine: FakeEngine) -> None:
    engine.fail_call(CallMethod.UNLOAD, 409, "busy", "loading a model")
    result = client_for(engine).simulate_post("/unload")
    assert result.status_code == 409 and result.json["error"]["code"] == "busy"
    engine.up = False
    down = client_for(engine).simulate_get("/stats")
    assert down.status_code == 503 and down.json["error"]["code"] == "engine_unavailable"


def test_tokenize_prompt_or_messages_and_detokenize(engine: FakeEngine) -> None:
    client = client_for(engine)
    assert client.simulate_post("/v1/tokenize", json={"prompt": "abc"}).json == {
        "tokens": [1, 2, 3], "count": 3, "max_model_len": 4096}
    client.simulate_post("/tokenize", json={"messages": [{"role": "developer", "content": "x"}]})
    both = client.simulate_post("/v1/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400 and both.json["error"]["param"] == "prompt"
    assert client.simulate_post("/v1/detokenize", json={"tokens": [1, 2]}).json == {"prompt": "ab"}
    bad = client.simulate_post("/v1/detokenize", json={"tokens": [1, True]})
    assert bad.status_code == 400 and bad.json["error"]["code"] == "invalid_type"
    assert [(method, args.get("messages")) for method, args in engine.calls] == [
        ("tokenize", None), ("tokenize", [{"role": "system", "content": "x"}]), ("detokenize", None)]


def test_adapters_are_validated_before_the_registry_call(engine: FakeEngine) -> None:
    client = client_for(engine)
    bad = client.simulate_post("/v1/adapters", json={"name": "../x", "path": "/a"})
    assert bad.status_code == 400 and bad.json["error"]["param"] == "name"
    assert client.simulate_post("/v1/adapters", json={"name": "mine", "path": "/a"}).json["name"] == "mine"
    assert client.simulate_get("/v1/adapters").json == {"object": "list", "data": []}
    assert client.simulate_delete("/v1/adapters/mine").json == {"deleted": True}
    assert engine.calls == [("adapters.add", {"name": "mine", "path": "/a"}), ("adapters.list", {}),
                            ("adapters.remove", {"name": "mine"})]


def test_metrics_count_requests_and_show_the_engine(engine: FakeEngine) -> None:
    client = client_for(engine)
    client.simulate_get("/v1/models")
    client.simulate_get("/v1/nothing-here")
    text = client.simulate_get("/metrics").text
    assert 'route="/v1/models",method="GET",status="200"} 1' in text
    assert 'route="other",method="GET",status="404"} 1' in text
    assert "mlx_engine_up 1" in text and "mlx_engine_prompt_cache_hit_rate 0.25" in text
    engine.up = False
    assert "mlx_engine_up 0" in client.simulate_get("/metrics").text


def test_openapi_document_is_served(engine: FakeEngine) -> None:
    document = client_for(engine).simulate_get("/openapi.json").json
    assert document["openapi"].startswith("3.") and "/v1/chat/completions" in document["paths"]
    assert engine.calls == []


def test_metrics_show_an_engine_groups_failure() -> None:
    """Red team: while a group failed, /metrics only said `state="stalled"`, like any slow step."""
    from http_frontend.service.metrics import engine_lines

    healthy = "\n".join(engine_lines({"state": "ready", "group": {"mode": "tp", "size": 2, "failed": False}}))
    assert 'mlx_engine_group_ranks{mode="tp"} 2' in healthy and "mlx_engine_group_failed 0" in healthy
    assert "mlx_engine_group_failed_rank" not in healthy
    failed = "\n".join(engine_lines({"state": "stalled", "group": {"mode": "tp", "size": 2, "failed": True,
                                                                   "failed_rank": 1}}))
    assert "mlx_engine_group_failed 1" in failed and "mlx_engine_group_failed_rank 1" in failed
    assert "mlx_engine_group" not in "\n".join(engine_lines({"state": "ready"}))  # one engine: none of them
