"""Two engines behind one two-worker front-end, for the several-engines outage tests.

Engine a loads `tiny-a` (its --model-dir lists it); engine b loads another random model served as
`bee`, listed as `tiny-b` under its own --model-dir. Real processes: the daemons and gunicorn.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from protocol import request_id_owner
from tests.helpers import Engine, Frontend

HI = [{"role": "user", "content": "hi"}]
GENERATION = {  # API -> (path, body without the model)
    "chat": ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
    "messages": ("/v1/messages", {"messages": HI, "max_tokens": 2}),
}


@contextlib.contextmanager
def two_engines(tiny_model: Path, ipc_dir: Path, base: Path, name: str) -> Iterator[tuple[dict[str, Engine], Frontend]]:
    """Engines a and b (sockets named after `name`) and a front-end routing to both; all stopped after."""
    from model_builders.text import build_model

    shutil.copytree(tiny_model, base / "ma" / "tiny-a")
    build_model(base / "mb" / "tiny-b", size="tiny", seed=5)
    endpoints = {engine_id: f"ipc://{ipc_dir}/{name}-{engine_id}.sock" for engine_id in ("a", "b")}
    engines = {"a": Engine(endpoints["a"], base / "a.log", model=str(base / "ma" / "tiny-a"),
                           args=["--model-dir", str(base / "ma")]),
               "b": Engine(endpoints["b"], base / "b.log", model=str(base / "mb" / "tiny-b"),
                           args=["--model-dir", str(base / "mb"), "--served-model-name", "bee"])}
    front = None
    try:
        for engine in engines.values():
            engine.wait_ready()
        front = Frontend(f"a={endpoints['a']}", base / "frontend.log", workers=2,
                         args=["--endpoint", f"b={endpoints['b']}"])
        front.wait_healthy()
        yield engines, front
    finally:
        if front is not None:
            front.stop()
        for engine in engines.values():
            engine.stop()


def post(front: Frontend, path: str, body: dict) -> httpx.Response:
    """One request on a fresh connection, so that either worker may answer it."""
    return httpx.post(front.base_url + path, json=body, timeout=60, headers={"Connection": "close"})


def workers_of(master: int) -> set[int]:
    """The gunicorn master's worker processes."""
    found = subprocess.run(["pgrep", "-P", str(master)], capture_output=True, text=True).stdout.split()
    return {int(pid) for pid in found}


def serving_workers(front: Frontend, tries: int = 600) -> set[str]:
    """The front-end ids of the workers that served engine a's model (both, when both are up).

    A worker gunicorn just started may take seconds to serve on a loaded machine, and the kernel may hand
    every new connection to the other one meanwhile: asked again, a little later each time, until both did."""
    served_by: set[str] = set()
    for _ in range(tries):
        answer = post(front, "/v1/chat/completions", {"model": "tiny-a", "messages": HI, "max_tokens": 1})
        if answer.status_code == 200:
            served_by.add(request_id_owner(answer.headers["x-request-id"]))
        if len(served_by) == 2:
            break
        time.sleep(0.05)
    return served_by


def engine_states(front: Frontend, engine_id: str, tries: int = 600) -> dict[str, str]:
    """Each worker's state of engine `engine_id` (`GET /admin/engines`, keyed by the worker's front-end id)."""
    views: dict[str, str] = {}
    for _ in range(tries):
        view = httpx.get(front.base_url + "/admin/engines", timeout=60, headers={"Connection": "close"}).json()
        views[view["frontend"]] = next(e["state"] for e in view["data"] if e["id"] == engine_id)
        if len(views) == 2:
            break
        time.sleep(0.05)
    return views
