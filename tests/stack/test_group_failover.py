"""Two engines behind one front-end, one of them a 2-rank engine group: when the group fails (kill -9 of
rank 1), what it had not accepted yet moves to the other engine (503 engine_group_failed is a lost engine
to the front-end), and what it was generating ends with engine_group_failed (nothing can move mid-stream)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend
from tests.stack.test_groups import _group_port, _kill_quietly, stream_text

MODEL = "tiny-group"  # by the name both engines serve it under: the router keeps a session on its engine


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_builders.text import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-group", size="tiny-group", seed=0)


def body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def test_requests_the_failed_group_had_not_accepted_move_to_the_other_engine(model: Path, ipc_dir: Path,
                                                                              tmp_path: Path) -> None:
    port = _group_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    group_endpoint, single_endpoint = f"ipc://{ipc_dir}/fo-group.sock", f"ipc://{ipc_dir}/fo-single.sock"
    # One decode slot on the group: a second and third request wait in its queue, not accepted.
    ranks = [Engine(group_endpoint, tmp_path / f"rank{rank}.log", model=str(model),
                    args=["--group", "tp", "--group-exit-delay", "10", "--decode-concurrency", "1",
                          "--served-model-name", MODEL],
                    env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}) for rank in (0, 1)]
    single = Engine(single_endpoint, tmp_path / "single.log", model=str(model), args=["--served-model-name", MODEL])
    frontend = Frontend(f"g={group_endpoint}", tmp_path / "frontend.log", workers=1,
                        args=["--endpoint", f"s={single_endpoint}"])
    try:
        ranks[0].wait_ready(90)
        single.wait_ready(90)
        frontend.wait_healthy(30)
        base = frontend.base_url
        # A session the router sends to the group (rendezvous hashing of the session header).
        for n in range(64):
            headers = {"x-session-id": f"session-{n}"}
            r = httpx.post(f"{base}/v1/chat/completions", json=body("hi", 1, False), headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            if r.headers.get("x-engine-id") == "g":
                break
        else:
            pytest.fail("no session routed to the group")
        flowing = threading.Event()

        def streamed() -> tuple[str, list[dict]]:
            return stream_text(base, body("Talk for a long time.", 4000, True),
                               on_chunk=lambda n: flowing.set() if n >= 3 else None, headers=headers)

        def waiting(prompt: str) -> httpx.Response:
            return httpx.post(f"{base}/v1/chat/completions", json=body(prompt, 8, False), headers=headers,
                              timeout=60)

        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(streamed)
            assert flowing.wait(60), "the group's stream never flowed"
            queued = [pool.submit(waiting, prompt) for prompt in ("Tell me about the sea.", "Count to five.")]
            deadline = time.monotonic() + 30
            while _engine(base, "g")["engine"]["queued"] < 2:
                assert time.monotonic() < deadline, "the two requests never queued on the group"
                time.sleep(0.05)
            rank1 = _engine(base, "g")["group"]["ranks"][1]["pid"]
            _kill_quietly(rank1, signal.SIGKILL)
            _, events = running.result(60)
            replies = [future.result(60) for future in queued]
        # The stream the group was generating ends with the group's error; nothing else could be done for it.
        assert "error" in events[-2] and events[-2]["error"]["code"] == "engine_group_failed", events[-3:]
        # The two it had not accepted were served by the other engine, with the same session header.
        for reply in replies:
            assert reply.status_code == 200, reply.text
            assert reply.headers.get("x-engine-id") == "s", dict(reply.headers)
            assert reply.json()["usage"]["completion_tokens"] == 8
        log = frontend.log()
        assert log.count("engine g was lost before it accepted") == 2, log[-3000:]
        assert "engine_group_failed" in ranks[0].log() or "engine group failed" in ranks[0].log()
    finally:
        frontend.stop()
        for engine in (*ranks, single):
            if engine.popen.poll() is None:
                _kill_quietly(engine.pid, signal.SIGKILL)
            engine.stop()


def _engine(base: str, engine_id: str) -> dict:
    """One engine's entry of /health behind several engines."""
    engines = httpx.get(f"{base}/health", timeout=10).json()["engines"]
    return next(engine for engine in engines if engine["id"] == engine_id)
