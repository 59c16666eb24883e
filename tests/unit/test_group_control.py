"""The group control channel's start-up verdicts: heartbeat formats (an older engine's, "-" while loading)
and the REFUSE message rank 0 sends its followers."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import zmq

from engine_daemon.group.control import ControlClient, ControlServer
from engine_daemon.group.startup import check_weights
from tests.helpers import free_port


class FakeRouter:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames)


def _server(size: int = 2) -> tuple[ControlServer, zmq.Context]:
    context = zmq.Context()
    return ControlServer(context, "tcp://127.0.0.1:1", size), context


def _close(server: ControlServer, context: zmq.Context) -> None:
    server._wake_in.close(linger=0)
    server._waker.close(linger=0)
    context.term()


def test_heartbeat_formats_tell_an_older_engine_from_a_rank_still_loading() -> None:
    server, context = _server(size=4)
    older: list[tuple[int, int]] = []
    server.on_older = lambda rank, fields: older.append((rank, fields))
    router = FakeRouter()
    try:
        server._heard(router, b"a", b"HB 1 10 20 111 abcdef 3 1")  # today's format
        server._heard(router, b"b", b"HB 2 10 20 222 - -1 0")  # loaded nothing yet
        server._heard(router, b"c", b"HB 3 10 20 333")  # before the weights check (273d314 .. ddc8ebb)
        server._heard(router, b"c", b"HB 3 10 20 333")
        assert server.reports[1]["weights_digest"] == "abcdef" and server.progress[1] == (3, True)
        assert "weights_digest" not in server.reports[2] and 2 not in server.older
        assert server.older == {3: 4} and server.reports[3]["older_engine"] is True
        assert older == [(3, 4)]  # once per rank
        server._heard(router, b"d", b"HB 2 10 20")  # the first engine groups: no pid either
        assert server.older[2] == 3 and server.reports[2]["pid"] is None
        assert [frames[1] for frames in router.sent] == [b"ACK"] * 5
    finally:
        _close(server, context)


def test_check_weights_refuses_an_older_engine_at_once_and_waits_for_a_loading_one() -> None:
    loaded = SimpleNamespace(weights_digest="abc", ref=SimpleNamespace(path="/m"))
    control = SimpleNamespace(size=3, reports={1: {"weights_digest": "abc"}, 2: {}}, older={2: 4})
    started = time.monotonic()
    reason, rank = check_weights(loaded, control, timeout=30.0)
    assert rank == 2 and "rank 2 runs an older mlx-engined" in reason and "versions differ" in reason
    assert time.monotonic() - started < 5.0
    control.older = {}  # rank 2 sends "-": still loading, waited for until the timeout
    reason, rank = check_weights(loaded, control, timeout=0.2)
    assert rank == 2 and "reported no weights digest" in reason


class RecordingClient(ControlClient):
    """Records REFUSE instead of exiting the process."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.refused: list[str] = []
        self.told = threading.Event()

    def _refused(self, reason: str) -> None:
        self.refused.append(reason)
        self.told.set()
        self.stop()


def test_a_refusal_reaches_every_follower_even_one_that_joins_later() -> None:
    context = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = ControlServer(context, endpoint, 3)
    server.start()
    clients = [RecordingClient(context, endpoint, rank, lambda: (1, 2), digest=lambda: "abc") for rank in (1, 2)]
    try:
        clients[0].start()
        deadline = time.monotonic() + 10
        while 1 not in server.reports:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert server.refuse("rank 2 loaded other weights", wait=5.0)
        assert clients[0].told.wait(5.0) and clients[0].refused == ["rank 2 loaded other weights"]
        clients[1].start()  # its first heartbeat is answered with the refusal
        assert clients[1].told.wait(5.0) and clients[1].refused == ["rank 2 loaded other weights"]
    finally:
        for client in clients:
            client.stop()
            if client.is_alive():
                client.join(5)
        server.stop()
        context.term()


def test_an_older_heartbeat_keeps_only_its_fields() -> None:
    client = ControlClient(None, "tcp://127.0.0.1:1", 1, lambda: (10, 20), digest=lambda: "abc", older_fields=4)
    fields = client._heartbeat().split()
    assert fields[0] == b"HB" and fields[1:4] == [b"1", b"10", b"20"] and len(fields) == 5
    assert len(ControlClient(None, "x", 1, lambda: (10, 20))._heartbeat().split()) == 8


def test_flushing_a_refusal_waits_until_the_control_thread_sent_it() -> None:
    """`GroupFaults` exits with `os._exit` right after its delay (0 with --group-exit-delay 0): it first waits
    for a refusal set with `refuse(wait=0)` to be sent, which takes the control thread's next pass."""
    context = zmq.Context()
    server = ControlServer(context, f"tcp://127.0.0.1:{free_port()}", 2)
    server.start()
    try:
        assert not server.refuse("rank 1 runs an older engine", wait=0)  # as `on_older` does, on that thread
        server.flush_refusal(timeout=5.0)
        assert server._refusal_sent.is_set()
    finally:
        server.stop()
        context.term()
