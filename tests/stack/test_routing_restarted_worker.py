"""Several engines, b down, one gunicorn worker restarted since: both workers answer every request alike.

Red team after session 31: engine b (its model loaded as `bee`, `tiny-b` under its --model-dir) was
killed, then one of two workers (SIGKILL: gunicorn starts another). The worker that survived had
listed b's models, the new one never heard b: for a model no engine serves, the new worker answered
503 and the old one 404, the same request; `GET /v1/models/tiny-b` said the model does not exist
(404) where running it was a 503; and the new worker took 2 s for every `/v1/models` and `/health`,
waiting on b. Real processes: two engines, a two-worker front-end.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Frontend
from tests.stack.two_engines import GENERATION, HI, engine_states, post, serving_workers, two_engines, workers_of

COUNTING = {  # the other routes that name a model
    "tokenize": ("/v1/tokenize", {"prompt": "hi"}),
    "tokenize-chat": ("/v1/tokenize", {"messages": HI}),
    "detokenize": ("/v1/detokenize", {"tokens": [1, 2]}),
    "count_tokens": ("/v1/messages/count_tokens", {"messages": HI}),
}
ANTHROPIC = ("messages", "count_tokens")
ROUNDS = 6  # each request this often, on fresh connections: both workers answer some


@pytest.fixture(scope="module")
def stack(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    with two_engines(tiny_model, ipc_dir, tmp_path_factory.mktemp("routing-restarted"), "restarted") as started:
        yield started


def get(front: Frontend, path: str) -> httpx.Response:
    return httpx.get(front.base_url + path, timeout=60, headers={"Connection": "close"})


def test_an_old_and_a_restarted_worker_answer_alike_while_an_engine_is_down(stack: tuple) -> None:
    engines, front = stack
    assert post(front, "/v1/chat/completions", {"model": "bee", "messages": HI, "max_tokens": 1}
                ).headers["x-engine-id"] == "b"
    assert len(serving_workers(front)) == 2  # both workers listed both engines

    os.killpg(engines["b"].pid, signal.SIGKILL)
    engines["b"].popen.wait(10)
    for _ in range(100):  # until both workers take b as down
        states = engine_states(front, "b")
        if set(states.values()) == {"unreachable"} and len(states) == 2:
            break
        time.sleep(0.1)
    assert set(states.values()) == {"unreachable"} and len(states) == 2, states

    old = workers_of(front.popen.pid)
    assert len(old) == 2, old
    killed = min(old)
    os.kill(killed, signal.SIGKILL)
    for _ in range(600):
        now = workers_of(front.popen.pid)
        if len(now) == 2 and killed not in now:
            break
        time.sleep(0.1)
    assert len(now) == 2 and killed not in now, (old, now)
    served_by = serving_workers(front)
    assert len(served_by) == 2 and any(f"-{max(old)}-" in owner for owner in served_by), served_by

    answers = []
    for _ in range(ROUNDS):
        for name in ("bee", "tiny-b"):
            for api, (path, body) in {**GENERATION, **COUNTING}.items():
                answers.append((name, api, post(front, path, {**body, "model": name})))
            answers.append((name, "retrieve", get(front, f"/v1/models/{name}")))
    wrong = [(name, api, r.status_code, r.text[:200]) for name, api, r in answers
             if r.status_code != 503 or r.headers.get("retry-after") != "1"]
    assert not wrong, wrong
    for name, api, answer in answers:
        error = answer.json()
        if api in ANTHROPIC:
            assert error["type"] == "error" and error["error"]["type"] == "overloaded_error", error
        else:
            assert error["error"]["code"] == "engine_unavailable", error
        assert name in error["error"]["message"] and "(b)" in error["error"]["message"], error

    # A model no engine serves: the same 404 from the worker that survived and from the one gunicorn restarted.
    unknown = [(api, post(front, path, {**body, "model": "never-served-anywhere"}))
               for _ in range(ROUNDS) for api, (path, body) in {**GENERATION, **COUNTING}.items()
               if api != "detokenize"]
    unknown += [("retrieve", get(front, "/v1/models/never-served-anywhere")) for _ in range(ROUNDS)]
    wrong = [(api, r.status_code, r.text[:200]) for api, r in unknown if r.status_code != 404]
    assert not wrong, wrong

    # Both workers answer what the live engine serves, b down in each one's view. (That a worker which never heard
    # b does not wait on it for these is test_an_engine_that_never_answered_is_down_for_calls_after_its_silence:
    # a duration measured here would be the client's clock.)
    states = engine_states(front, "b")
    assert len(states) == 2 and set(states.values()) == {"unreachable"}, states
    for _ in range(ROUNDS):
        for path in ("/v1/models", "/health", "/v1/models/tiny-a"):
            assert get(front, path).status_code == 200, path
    assert post(front, "/v1/tokenize", {"model": "tiny-a", "prompt": "hi"}).status_code == 200
