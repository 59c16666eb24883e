"""Several engines, one of them down: a request for its model is its outage (503), on every worker and API.

Red team: engine b (its model loaded as `bee`, listed as `tiny-b` under its --model-dir) was killed;
requests naming `tiny-b` got 503 `engine_unavailable` from a gunicorn worker that had once resolved
that spelling and engine a's 404 `model_not_found` from the others; its path got a's 400
`invalid_model_name`; `/v1/messages` a 404 `not_found_error`. None retryable. Every worker now lists
every engine's catalogue at start and keeps the last one while the engine is down. Real processes:
two engines with a model each, a two-worker front-end. No name of b's but `bee` is sent before b dies,
so no worker learned one from a request.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from protocol import request_id_owner
from tests.helpers import Engine, Frontend, ping_engine
from tests.stack.two_engines import GENERATION, HI, serving_workers, two_engines, workers_of

REQUESTS = GENERATION
ROUNDS = 3  # each (name, API, stream) this often, on fresh connections: both workers answer some


class Outage:
    def __init__(self, root: Path, engines: dict[str, Engine], front: Frontend):
        self.root, self.engines, self.front = root, engines, front

    def ask(self, api: str, model: str, stream: bool = False) -> httpx.Response:
        path, body = REQUESTS[api]
        return httpx.post(self.front.base_url + path, json={**body, "model": model, "stream": stream}, timeout=60,
                          headers={"Connection": "close"})

    def engine_states(self) -> set[str]:
        """Engine b's state in the view of whichever workers answered (`/admin/engines`)."""
        states = set()
        for _ in range(8):
            view = httpx.get(f"{self.front.base_url}/admin/engines", timeout=10, headers={"Connection": "close"})
            states |= {e["state"] for e in view.json()["data"] if e["id"] == "b"}
        return states


@pytest.fixture(scope="module")
def outage(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    base = tmp_path_factory.mktemp("routing-outage")
    with two_engines(tiny_model, ipc_dir, base, "outage") as (engines, front):
        yield Outage(base, engines, front)


def test_every_request_for_a_down_engines_model_is_a_503_on_every_worker_and_api(outage: Outage) -> None:
    b_path = str(outage.root / "mb" / "tiny-b")
    assert ping_engine(outage.engines["b"].endpoint)["model"] == "bee"
    served = outage.ask("chat", "bee")
    assert served.status_code == 200 and served.headers["x-engine-id"] == "b", served.text
    workers = set()
    for _ in range(16):  # both workers serve (their rids name them): each holds its own view of b
        answer = outage.ask("chat", "tiny-a")
        assert answer.status_code == 200 and answer.headers["x-engine-id"] == "a", answer.text
        workers.add(request_id_owner(answer.headers["x-request-id"]))
    assert len(workers) == 2, workers

    os.killpg(outage.engines["b"].pid, signal.SIGKILL)
    outage.engines["b"].popen.wait(10)
    for _ in range(100):  # until the workers say b is down (its pings unanswered)
        if outage.engine_states() == {"unreachable"}:
            break
    assert outage.engine_states() == {"unreachable"}

    answers = []
    for _ in range(ROUNDS):
        for name in ("bee", "tiny-b", b_path, f"{b_path}/"):
            for api in REQUESTS:
                for stream in (False, True):
                    answers.append((name, api, stream, outage.ask(api, name, stream)))
    wrong = [(name, api, stream, r.status_code, r.text[:200]) for name, api, stream, r in answers
             if r.status_code != 503 or r.headers.get("retry-after") != "1"]
    assert not wrong, wrong
    for name, api, _, answer in answers:
        error = answer.json()
        if api == "messages":  # Anthropic's envelope, as for every 503
            assert error["type"] == "error" and error["error"]["type"] == "overloaded_error", error
        else:
            assert error["error"]["code"] == "engine_unavailable", error
        assert name in error["error"]["message"], error

    # A model no engine serves or lists is still the other engine's 404; engine a still serves its own.
    for api in REQUESTS:
        unknown = outage.ask(api, "never-served-anywhere")
        assert unknown.status_code == 404, unknown.text
    assert outage.ask("messages", "never-served-anywhere").json()["error"]["type"] == "not_found_error"
    assert outage.ask("chat", "tiny-a").status_code == 200


def test_workers_started_after_the_engine_died_and_token_counts_answer_503(outage: Outage) -> None:
    """Session 30 left two gaps: a worker started after b died never had b's catalogue and answered a's 404 for
    b's model (the other workers 503), and /v1/tokenize and count_tokens naming b's model got a's 404 on every
    worker. Both workers are killed here once b is down: gunicorn's new ones never heard b list anything."""
    engine_b = outage.engines["b"]
    if engine_b.popen.poll() is None:
        os.killpg(engine_b.pid, signal.SIGKILL)
        engine_b.popen.wait(10)
    old = workers_of(outage.front.popen.pid)
    assert len(old) == 2, old
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    for _ in range(600):  # gunicorn starts two new workers
        new = workers_of(outage.front.popen.pid)
        if len(new) == 2 and not new & old:
            break
        time.sleep(0.1)
    assert len(new) == 2 and not new & old, (old, new)
    served_by = serving_workers(outage.front)  # both new workers up and serving a's model
    assert len(served_by) == 2, served_by

    answers = [(name, api, outage.ask(api, name)) for _ in range(ROUNDS) for name in ("bee", "tiny-b")
               for api in REQUESTS]
    for name, path, body in (("bee", "/v1/tokenize", {"prompt": "hi"}),
                             ("tiny-b", "/v1/tokenize", {"messages": HI}),
                             ("tiny-b", "/v1/messages/count_tokens", {"messages": HI})):
        for _ in range(ROUNDS):
            answers.append((name, path, httpx.post(outage.front.base_url + path, json={**body, "model": name},
                                                   timeout=60, headers={"Connection": "close"})))
    wrong = [(name, api, r.status_code, r.text[:200]) for name, api, r in answers
             if r.status_code != 503 or r.headers.get("retry-after") != "1"]
    assert not wrong, wrong
    for _, api, answer in answers:
        error = answer.json()
        if api in ("messages", "/v1/messages/count_tokens"):
            assert error["error"]["type"] == "overloaded_error", error
        else:
            assert error["error"]["code"] == "engine_unavailable", error
    assert outage.ask("chat", "tiny-a").status_code == 200

