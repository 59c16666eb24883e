"""Random frames thrown at the engine socket while a good client is served (hypothesis).

Garbage, truncated, oversized-looking, wrong-version and well-formed-but-nonsense
frames, from throwaway DEALER sockets, for FUZZ_SECONDS (default 60). The engine
must answer or drop them and keep serving a concurrent client through the real
front-end.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import PROTOCOL_VERSION, MsgType, encode
from protocol.messages import PARAM_TYPES
from tests.helpers import Engine, Frontend, ping_engine

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "60"))

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=30)
    | st.binary(max_size=30),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=15,
)
type_bytes = st.sampled_from([int(t) for t in MsgType]) | st.integers(0, 255)
random_map_frames = st.builds(lambda t, body: bytes([t]) + msgpack.packb(body, use_bin_type=True),
                              type_bytes, values)
add_frames = st.builds(
    lambda rid, params, messages, prompt: encode(MsgType.ADD, {
        "rid": rid, "params": params, **({"messages": messages} if messages is not None else {}),
        **({"prompt": prompt} if prompt is not None else {})}),
    st.text(max_size=20),
    st.dictionaries(st.sampled_from(sorted(PARAM_TYPES)), values, max_size=4)
    | st.fixed_dictionaries({"max_tokens": st.integers(1, 16), "temperature": st.floats(0, 2)}),
    st.none() | st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]), values, max_size=3), max_size=3),
    st.none() | st.text(max_size=50) | st.lists(st.integers(-5, 5000), max_size=10),
)
hello_frames = st.builds(lambda v, fid: encode(MsgType.HELLO, {"version": v, "frontend_id": fid}),
                         st.integers(-3, PROTOCOL_VERSION + 3), st.text(max_size=10))
call_frames = st.builds(lambda cid, method, args: encode(MsgType.CALL, {"cid": cid, "method": method, "args": args}),
                        st.text(max_size=8), st.sampled_from(["status", "stats", "list_models", "nope", ""]),
                        st.dictionaries(st.text(max_size=5), values, max_size=3))
truncated = st.builds(lambda frame, cut: frame[:cut], add_frames | hello_frames, st.integers(0, 40))
frames = st.binary(max_size=300) | random_map_frames | add_frames | hello_frames | call_frames | truncated
messages = st.lists(frames, min_size=1, max_size=3)  # extra frames make a malformed multipart message


@pytest.fixture(scope="module")
def fuzz_stack(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    logs = tmp_path_factory.mktemp("fuzz")
    engine = Engine(f"ipc://{ipc_dir}/fuzz.sock", logs / "engined.log", model=str(tiny_model))
    frontend = Frontend(engine.endpoint, logs / "frontend.log", workers=1)
    try:
        engine.wait_ready()
        frontend.wait_healthy()
        yield engine, frontend
    finally:
        frontend.stop()
        engine.stop()


def test_random_frames_never_stop_the_engine(fuzz_stack: tuple) -> None:
    engine, frontend = fuzz_stack
    context = zmq.Context.instance()
    deadline = time.monotonic() + FUZZ_SECONDS
    served: list[int] = []
    stop = threading.Event()

    def good_client() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                r = http.post(f"{frontend.base_url}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0})
                served.append(r.status_code)

    client = threading.Thread(target=good_client)
    client.start()
    sent = 0

    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(messages, min_size=1, max_size=10))
    def throw(batch: list[list[bytes]]) -> None:
        nonlocal sent
        if time.monotonic() > deadline:
            return
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine.endpoint)
        try:
            for parts in batch:
                sock.send_multipart(parts)
                sent += 1
            while sock.poll(5):  # read whatever the engine answers, then vanish
                sock.recv_multipart()
        finally:
            sock.close()

    try:
        while time.monotonic() < deadline:
            throw()
    finally:
        stop.set()
        client.join(60)
    assert engine.popen.poll() is None, engine.log()[-3000:]
    assert sent > 1000
    assert served and set(served) == {200}, f"good client saw {sorted(set(served))}"
    assert ping_engine(engine.endpoint)["state"] == "ready"
    assert "bad frame" in engine.log()
