"""The admission pool (`Preprocessor`): fair between clients, bounded per client, and what it drops it never renders.

Red team: the pool was one FIFO with no bound, rendered requests already aborted, let any front-end's
ABORT drop another's request, and lost a request whose id arrived twice while the first copy was in it.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from engine_daemon.errors import RequestError
from engine_daemon.request import preprocess
from engine_daemon.request.preprocess import Preprocessor, check_token_prompt
from engine_daemon.request.state import PreparedPrompt
from protocol.token_ids import pack_token_ids

A, B = b"front-a", b"front-b"


def fake_model(window: int | None = 100, vocab: int = 1000) -> Any:
    return SimpleNamespace(ref=SimpleNamespace(id="m", path="/m"), loaded_at=1.0, kind="text", vision=None,
                           context_window=window, vocab_size=vocab)


class Pool:
    """A one-thread Preprocessor whose renders are recorded, the first one held until `release`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, max_queued: int = 256):
        self.rendered: list[str] = []
        self.delivered: list[tuple[bytes, str, PreparedPrompt | None]] = []
        self.gate, self.holding = threading.Event(), threading.Event()

        def render(body: dict[str, Any], loaded: Any) -> PreparedPrompt:
            if not self.rendered:
                self.holding.set()
                self.gate.wait(10)
            self.rendered.append(body["rid"])
            return PreparedPrompt(("m", 1.0), tokens=[1, 2])

        monkeypatch.setattr(preprocess, "prepare_prompt", render)
        self.pre = Preprocessor(fake_model, lambda peer, body, prepared: self.delivered.append(
            (peer, body["rid"], prepared)), threads=1, max_queued=max_queued)

    def add(self, peer: bytes, rid: str, client: str = "", prompt: Any = "hi") -> None:
        self.pre.submit(peer, {"rid": rid, "client": client, "prompt": prompt, "params": {}})

    def hold(self, peer: bytes = A, rid: str = "first") -> None:
        self.add(peer, rid)
        assert self.holding.wait(5)

    def release(self) -> None:
        self.gate.set()
        deadline = time.monotonic() + 10
        while self.pre.stats()["prompts_preparing"] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # pool tasks left over from dropped jobs find nothing
        self.pre.close()

    def refusals(self) -> dict[str, str]:
        return {rid: prepared.error.code for _, rid, prepared in self.delivered if prepared and prepared.refusal}


def test_requests_aborted_while_waiting_are_never_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool(monkeypatch)
    pool.hold()
    for i in range(5):
        pool.add(A, f"a{i}")
    pool.add(B, "b0")
    pool.pre.cancel(A, ["a0", "a1", "a2"])
    pool.pre.cancel_peer(B)
    pool.release()
    assert pool.rendered == ["first", "a3", "a4"]
    assert [rid for _, rid, _ in pool.delivered] == ["first", "a3", "a4"]
    assert pool.pre.stats()["prompts_dropped_unrendered"] == 4


def test_clients_are_served_round_robin(monkeypatch: pytest.MonkeyPatch) -> None:
    """One client's backlog delays another's first request by one render at most."""
    pool = Pool(monkeypatch)
    pool.hold()
    for i in range(10):
        pool.add(A, f"a{i}", client="flood")
    pool.add(A, "v0", client="victim")  # same front-end, another client (API key / user)
    pool.add(B, "w0")  # another front-end
    pool.add(A, "v1", client="victim")
    pool.release()
    assert pool.rendered[:6] == ["first", "a0", "v0", "w0", "a1", "v1"], pool.rendered
    assert len(pool.rendered) == 14


def test_a_call_takes_its_turn_with_the_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """A /tokenize CALL (or an auxiliary job's tokenizing) waits one render, not a client's whole backlog."""
    pool = Pool(monkeypatch)
    pool.hold()
    for i in range(5):
        pool.add(A, f"a{i}")
    answers: list[tuple[Any, Any]] = []
    pool.pre.run_call(lambda: pool.rendered.append("call") or 7, lambda result, error: answers.append((result, error)))
    pool.release()
    assert pool.rendered[:4] == ["first", "a0", "call", "a1"] and answers == [(7, None)]


def test_one_client_holds_at_most_max_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool(monkeypatch, max_queued=3)
    pool.hold(A)  # client "" of front-end A: one of its three
    for i in range(4):
        pool.add(A, f"a{i}")
    pool.add(A, "k0", client="key")
    pool.release()
    assert pool.refusals() == {"a2": "queue_full", "a3": "queue_full"}
    refused = next(prepared.error for _, rid, prepared in pool.delivered if rid == "a2")
    assert refused.status == 429 and refused.error_type == "rate_limit_error"
    assert pool.rendered == ["first", "a0", "k0", "a1"]


def test_a_foreign_abort_leaves_the_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool(monkeypatch)
    pool.hold()
    pool.add(A, "a0")
    pool.pre.cancel(B, ["a0", "first"])
    pool.release()
    assert [rid for _, rid, _ in pool.delivered] == ["first", "a0"]


def test_a_duplicate_id_in_the_pool_is_refused_and_the_first_is_unaffected(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool(monkeypatch)
    pool.hold(A, "shared")
    pool.add(B, "shared")
    pool.release()
    assert pool.delivered[0][:2] == (B, "shared") and pool.delivered[0][2].error.code == "duplicate_request_id"
    assert pool.delivered[0][2].error.status == 400
    assert pool.delivered[1][0] == A and pool.delivered[1][2].tokens == [1, 2]


def test_token_prompts_are_prepared_on_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool(monkeypatch)
    pool.add(A, "ids", prompt=[1, 2, 3])
    pool.release()
    assert pool.rendered == ["ids"] and pool.delivered[0][2].tokens == [1, 2]


def test_a_token_prompt_is_refused_by_its_length_before_its_ids_are_walked() -> None:
    class Unwalkable(list):
        def __iter__(self):
            raise AssertionError("walked")

    with pytest.raises(RequestError) as refused:
        check_token_prompt(Unwalkable(range(100)), fake_model(window=100))
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
    for bad in ([1, True], [1, 1000], [1, -1], [1, "2"], [1, 2.0]):
        with pytest.raises(RequestError) as refused:
            check_token_prompt(bad, fake_model())
        assert refused.value.code == "invalid_value"
    check_token_prompt([0, 999], fake_model())


def test_a_packed_token_prompt_is_refused_by_its_byte_count_and_checked_once_unpacked() -> None:
    class Unreadable(bytes):
        def __iter__(self):
            raise AssertionError("read")

    with pytest.raises(RequestError) as refused:
        check_token_prompt(Unreadable(pack_token_ids([1] * 100)), fake_model(window=100))
    assert refused.value.code == "context_length_exceeded" and "has 100 tokens" in str(refused.value)
    with pytest.raises(RequestError) as refused:
        check_token_prompt(pack_token_ids([1, 1000]), fake_model())
    assert refused.value.code == "invalid_value"
    assert check_token_prompt(pack_token_ids([0, 999]), fake_model()) == [0, 999]


def test_close_answers_every_job_it_holds_once_and_renders_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM: ADDs waiting in the pool or being rendered, and CALLs waiting there, got no reply at all (their
    clients waited for the front-end's timeout). Now `close` answers each once; what it held is never handed on."""
    pool = Pool(monkeypatch)
    pool.hold()  # "first" is being rendered
    pool.add(A, "a0")
    pool.add(A, "a1", client="other")
    pool.add(B, "b0")
    answers: list[tuple[Any, Any]] = []
    pool.pre.run_call(lambda: pool.rendered.append("call") or 7, lambda result, error: answers.append((result, error)))
    assert sorted(pool.pre.close()) == [(A, "a0"), (A, "a1"), (A, "first"), (B, "b0")]
    assert [(result, error.code) for result, error in answers] == [(None, "engine_shutting_down")]
    pool.gate.set()  # the render in progress ends after the close
    time.sleep(0.2)
    assert pool.rendered == ["first"] and pool.delivered == []  # nothing handed on, nothing more rendered
    assert len(answers) == 1
    stats = pool.pre.stats()
    assert stats["prompts_preparing"] == 0 and stats["prompts_dropped_unrendered"] == 3


def test_a_call_running_at_close_is_answered_there_and_its_late_result_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool(monkeypatch)
    running, finish = threading.Event(), threading.Event()
    answers: list[tuple[Any, Any]] = []

    def slow_call() -> int:
        running.set()
        finish.wait(10)
        return 7

    pool.pre.run_call(slow_call, lambda result, error: answers.append((result, error)))
    assert running.wait(5)
    assert pool.pre.close() == []
    finish.set()
    time.sleep(0.2)
    assert [(result, error.code) for result, error in answers] == [(None, "engine_shutting_down")]
    # After the close (the mlx thread may still offload an auxiliary job, the io thread sends nothing more):
    pool.pre.run_call(lambda: 8, lambda result, error: answers.append((result, error)))
    assert answers[-1][0] is None and answers[-1][1].code == "engine_shutting_down"
    pool.add(A, "late")
    assert pool.refusals() == {"late": "engine_shutting_down"} and pool.rendered == []
