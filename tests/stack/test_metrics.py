"""GET /metrics and access lines through a real gunicorn front-end and a real engine."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Engine, Frontend

KEY = "sk-metrics"
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def observed(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    # One worker: each worker counts for itself, so a scrape must reach the one that served.
    proc = Frontend(engine.endpoint, tmp_path_factory.mktemp("metrics") / "frontend.log", workers=1,
                    args=["--api-key", KEY])
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """Families ({name: type}) and samples, checking the 0.0.4 text format line by line."""
    types: dict[str, str] = {}
    samples = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"family {name} declared twice"
            types[name] = kind
        elif line.startswith("# HELP ") or not line:
            continue
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.groups()
            samples.append((name, dict(LABEL.findall(labels or "")), float(value)))
    for name, _, _ in samples:
        assert any(name == family or name.startswith(family + "_") for family in types), name
    return types, samples


def value(samples: list, name: str, **labels: str) -> float:
    found = [v for n, have, v in samples if n == name and all(have.get(k) == want for k, want in labels.items())]
    assert found, f"no sample {name} {labels}"
    return sum(found)


def scrape(frontend: Frontend) -> tuple[dict[str, str], list]:
    response = httpx.get(f"{frontend.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


def test_metrics_after_a_streamed_request(observed: Frontend, model_id: str) -> None:
    client = openai.OpenAI(base_url=f"{observed.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    # Long enough that the tiny model's tokens reach the worker in several deltas (inter-token gaps).
    chunks = list(client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Count"}],
                                                 max_tokens=200, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Count"}], max_tokens=4,
                                   temperature=0)

    types, samples = scrape(observed)
    assert types["mlx_frontend_requests_total"] == "counter"
    assert types["mlx_frontend_time_to_first_token_seconds"] == "histogram"
    assert types["mlx_frontend_inter_token_latency_seconds"] == "histogram"
    assert types["mlx_frontend_open_streams"] == "gauge"
    assert value(samples, "mlx_frontend_time_to_first_token_seconds_count") >= 2  # streamed and not
    assert value(samples, "mlx_frontend_inter_token_latency_seconds_count") > 0
    assert 0 < value(samples, "mlx_frontend_time_to_first_token_seconds_sum") < 60
    inf_bucket = value(samples, "mlx_frontend_time_to_first_token_seconds_bucket", le="+Inf")
    assert inf_bucket == value(samples, "mlx_frontend_time_to_first_token_seconds_count")
    assert value(samples, "mlx_frontend_requests_total", route="/v1/chat/completions", method="POST",
                 status="200") == 2
    assert value(samples, "mlx_frontend_open_streams") == 0
    pids = {labels["pid"] for name, labels, _ in samples if name.startswith("mlx_frontend_")}
    assert len(pids) == 1 and pids.pop().isdigit()

    assert value(samples, "mlx_engine_up") == 1
    for name in ("mlx_engine_epoch", "mlx_engine_queued_requests", "mlx_engine_batch_size",
                 "mlx_engine_prompt_cache_hit_rate", "mlx_engine_prompt_cache_bytes"):
        assert name in types, name
    assert value(samples, "mlx_engine_tokens_generated_total") >= 12
    assert value(samples, "mlx_engine_tool_parses_timed_out_total") == 0  # no hostile markup in this run
    assert 0 <= value(samples, "mlx_engine_prompt_cache_hit_rate") <= 1
    assert value(samples, "mlx_engine_info", state="ready") == 1


def test_metrics_counts_refusals_under_their_route(observed: Frontend) -> None:
    assert httpx.get(f"{observed.base_url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{observed.base_url}/no/such/route", headers={"x-api-key": KEY}, timeout=10).status_code == 404
    _, samples = scrape(observed)
    assert value(samples, "mlx_frontend_requests_total", route="/v1/models", status="401") >= 1
    assert value(samples, "mlx_frontend_requests_total", route="other", status="404") >= 1


def test_metrics_needs_the_key(observed: Frontend) -> None:
    response = httpx.get(f"{observed.base_url}/metrics", timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_access_line_carries_the_engine_rid(observed: Frontend, engine: Engine, model_id: str) -> None:
    response = httpx.post(f"{observed.base_url}/v1/chat/completions", headers={"x-api-key": KEY}, timeout=60,
                          json={"model": model_id, "messages": [{"role": "user", "content": "trace me"}],
                                "max_tokens": 3})
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and f"rid={rid} " not in observed.log():
        time.sleep(0.1)
    line = next(line for line in observed.log().splitlines() if f"rid={rid} " in line)
    assert "route=/v1/chat/completions" in line and "status=200" in line and "duration_ms=" in line
    # The engine logged the same id: one request can be followed across processes.
    assert f"rid={rid} " in engine.log()


def test_metrics_with_the_engine_down(ipc_dir: Path, tmp_path: Path) -> None:
    proc = Frontend(f"ipc://{ipc_dir}/nobody-here.sock", tmp_path / "frontend.log", workers=1)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(f"{proc.base_url}/metrics", timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, proc.log()
                assert proc.popen.poll() is None, proc.log()
                time.sleep(0.1)
        assert response.status_code == 200
        types, samples = parse(response.text)
        assert value(samples, "mlx_engine_up") == 0
        assert not any(name.startswith("mlx_engine_") and name != "mlx_engine_up" for name in types)
        assert "mlx_frontend_requests_total" in types
    finally:
        proc.stop()
