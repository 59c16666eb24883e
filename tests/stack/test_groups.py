"""Engine groups (#16): a real 2-rank group over loopback (`mlx.launch --backend ring -n 2`), TP and PP.

One group per mode for the whole module (the last test breaks it on purpose), one single-process
engine for the reference outputs. The model is the `tiny-group` preset in float32: TP in bf16 or
4-bit rounds differently from one process, float32 gives the same tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, Proc, engine_env, running_stack

STEP_TIMEOUT = 3.0  # --group-step-timeout of the test groups (the SIGSTOP test waits for it)
PROMPTS = ["Hi", "Tell me about the sea and the ships on it.", "Count with me: one two three four five six.",
           "Write a long story about a fox, a dog, a river, a bridge and the town beyond the hills " * 3]
MAX_TOKENS = 40
SHARED = "Here is a long shared context about rivers, ships and harbours. " * 12  # a prefix two requests share
SCHEMA = {"type": "json_schema", "json_schema": {"name": "fact", "schema": {
    "type": "object", "properties": {"name": {"enum": ["fox", "dog", "river"]}, "count": {"enum": [1, 2, 3]}},
    "required": ["name", "count"], "additionalProperties": False}}}
CACHED_PROMPTS = [SHARED + "First question: what floats?", SHARED + "Second question: what sinks?"]
ADAPTER = "lora-group"  # a LoRA adapter for the group's model, next to it
EXIT_DELAY = 5.0  # --group-exit-delay: a failed rank 0 answers /health this long, then exits 75


def _ports_free(*ports: int) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _group_port() -> int:
    """A ring starting port P with P, P+1 (the two ranks) and P+100 (the control socket) free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000 and _ports_free(port + 1, port + 100):
            return port
    raise RuntimeError("no free port range for the group")


def chat(model: str, prompt: str, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, **extra}


def stream_text(base_url: str, body: dict, on_chunk=None, stop_after: int | None = None,
                headers: dict | None = None) -> tuple[str, list[dict]]:
    """The streamed text and every data payload; `stop_after` chunks: close the stream (an abort)."""
    text, events = "", []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60, headers=headers) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            event = {"done": True} if payload == "[DONE]" else json.loads(payload)
            events.append(event)
            for choice in event.get("choices", []):
                text += choice["delta"].get("content") or ""
            if on_chunk is not None:
                on_chunk(len(events))
            if stop_after is not None and len(events) >= stop_after:
                break
    return text, events


@pytest.fixture(scope="module")
def group_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_builders.adapter import build_adapter
    from model_builders.text import build_model

    model = build_model(tmp_path_factory.mktemp("models") / "tiny-group", size="tiny-group", seed=0)
    build_adapter(model, model.parent / ADAPTER, seed=1)  # under the groups' --model-dir, so it resolves
    return model


@pytest.fixture(scope="module")
def reference(group_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What one process serves: greedy texts, seeded texts, its weight bytes."""
    logs = tmp_path_factory.mktemp("single")
    with running_stack(f"ipc://{ipc_dir}/grp-single.sock", logs, model=str(group_model)) as (_, frontend):
        base = frontend.base_url
        greedy = [stream_text(base, chat("default", prompt))[0] for prompt in PROMPTS]
        seeded = [stream_text(base, chat("default", prompt, temperature=1.0, seed=1234))[0] for prompt in PROMPTS[:2]]
        cached = [_completion(base, prompt) for prompt in CACHED_PROMPTS]
        structured = [_completion(base, prompt, response_format=fmt)
                      for prompt, fmt in ((PROMPTS[1], SCHEMA), (PROMPTS[2], {"type": "json_object"}))]
        weights = sum(p.stat().st_size for p in group_model.glob("*.safetensors"))
    return {"greedy": greedy, "seeded": seeded, "weights_file_bytes": weights,
            "cached": [reply["choices"][0]["message"]["content"] for reply in cached],
            "structured": [reply["choices"][0]["message"]["content"] for reply in structured]}


def _completion(base_url: str, prompt: str, **extra: object) -> dict:
    body = chat("default", prompt, stream=False, **extra)
    if "response_format" in extra:
        body["ignore_eos"] = False  # the grammar ends the JSON with EOS
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@dataclass
class Group:
    mode: str
    launch: Proc
    frontend: Frontend
    endpoint: str

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.frontend.base_url}/health", timeout=10)

    def pids(self) -> list[int]:
        return [rank["pid"] for rank in self.health().json()["group"]["ranks"]]


@pytest.fixture(scope="module", params=["tp", "pp"])
def group(request: pytest.FixtureRequest, group_model: Path, ipc_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    mode = request.param
    logs = tmp_path_factory.mktemp(f"group-{mode}")
    endpoint = f"ipc://{ipc_dir}/grp-{mode}.sock"
    launcher = Path(sys.executable).parent / "mlx.launch"  # the venv's, next to this interpreter
    if not launcher.exists():
        launcher = Path(shutil.which("mlx.launch") or launcher)
    argv = [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
            "--starting-port", str(_group_port()), "--", sys.executable, "-m", "engine_daemon",
            "--endpoint", endpoint, "--model", str(group_model), "--model-dir", str(group_model.parent),
            "--group", mode,
            "--group-step-timeout", str(STEP_TIMEOUT), "--group-checksum-every", "4",
            "--group-exit-delay", str(EXIT_DELAY)]
    launch = Proc(argv, logs / "group.log", engine_env())
    frontend = Frontend(endpoint, logs / "frontend.log", workers=1)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert launch.popen.poll() is None, launch.log()
            try:
                if httpx.get(f"{frontend.base_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, launch.log()
            time.sleep(0.2)
        yield Group(mode, launch, frontend, endpoint)
    finally:
        frontend.stop()
        if launch.popen.poll() is None:
            os.killpg(launch.pid, signal.SIGTERM)  # mlx.launch and both ranks: rank 0 stops the group cleanly
            try:
                launch.popen.wait(20)
            except Exception:
                os.killpg(launch.pid, signal.SIGKILL)
        for pid in _group_pids(launch):
            _kill_quietly(pid, signal.SIGKILL)
        launch.stop()


def _group_pids(launch: Proc) -> list[int]:
    """Processes of the launcher's process group still alive (a stopped rank, say)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == launch.pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def test_greedy_matches_one_process_with_a_join_mid_batch_and_an_abort(group: Group, reference: dict) -> None:
    base = group.frontend.base_url
    flowing = threading.Event()

    def on_chunk(n: int) -> None:
        if n >= 4:
            flowing.set()

    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(stream_text, base, chat("default", PROMPTS[3]), on_chunk)
        second = pool.submit(stream_text, base, chat("default", PROMPTS[1]))
        aborted = pool.submit(stream_text, base, chat("default", PROMPTS[2]), None, 6)
        assert flowing.wait(60), "the first stream never flowed"
        joined = pool.submit(stream_text, base, chat("default", PROMPTS[0]))  # joins the running batch
        texts = {3: first.result(60)[0], 1: second.result(60)[0], 0: joined.result(60)[0]}
        partial = aborted.result(60)[0]
    for index, text in texts.items():
        assert text == reference["greedy"][index], f"prompt {index} differs from one process in {group.mode}"
    assert reference["greedy"][2].startswith(partial)
    stats = group.health().json()["group"]
    assert not stats["failed"] and stats["checksums"] > 0 and stats["checksum_tokens"] > 0
    # The aborted request left every rank's batch: the group keeps serving the same tokens.
    assert stream_text(base, chat("default", PROMPTS[2]))[0] == reference["greedy"][2]


def test_seeded_sampling_matches_one_process(group: Group, reference: dict) -> None:
    with ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(lambda p: stream_text(group.frontend.base_url,
                                                    chat("default", p, temperature=1.0, seed=1234))[0], PROMPTS[:2]))
    assert texts == reference["seeded"]


def test_group_reports_shards_and_idles_without_spinning(group: Group, reference: dict) -> None:
    health = group.health()
    assert health.status_code == 200
    info = health.json()["group"]
    assert info["mode"] == group.mode and info["size"] == 2 and not info["failed"]
    full = reference["weights_file_bytes"]
    for rank in info["ranks"]:
        # Each rank holds its shard plus what it must replicate (embeddings, norms): less than the model.
        assert 0.3 * full < rank["weights_bytes"] < 0.85 * full, (rank, full)
    assert len({rank["weights_digest"] for rank in info["ranks"]}) == 1 and info["ranks"][0]["weights_digest"]
    pids = group.pids()
    time.sleep(1.0)  # the last request's idle plan has gone out
    before = [_cpu_seconds(pid) for pid in pids]
    started = time.monotonic()
    time.sleep(5.0)
    elapsed = time.monotonic() - started
    used = [(_cpu_seconds(pid) - b) / elapsed for pid, b in zip(pids, before)]
    assert all(share < 0.02 for share in used), f"idle CPU per rank: {used}"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_prompt_cache_reuses_a_shared_prefix_on_every_rank(group: Group, reference: dict) -> None:
    """Rank 0 decides the reuse (which entry, how many tokens) and every rank takes its own shard's copy: the
    second request reports cached tokens and still generates exactly what one process generates."""
    first, second = (_completion(group.frontend.base_url, prompt) for prompt in CACHED_PROMPTS)
    assert [first["choices"][0]["message"]["content"],
            second["choices"][0]["message"]["content"]] == reference["cached"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 100, second["usage"]  # the shared context (well over 100 tokens), computed on no rank again
    print(f"\n{group.mode}: second request {second['usage']['prompt_tokens']} prompt tokens, {cached} cached")
    info = group.health().json()["group"]
    assert info["checksums"] > 0 and not info["failed"]


def test_structured_output_is_replayed_by_every_rank(group: Group, reference: dict) -> None:
    """Rank 0 carries the response_format in the plan; each follower builds the same grammar, fed the same
    tokens: constrained greedy text equals one process's (both at once: two grammars in one batch)."""
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda args: _completion(group.frontend.base_url, args[0], response_format=args[1]),
                                ((PROMPTS[1], SCHEMA), (PROMPTS[2], {"type": "json_object"}))))
    texts = [reply["choices"][0]["message"]["content"] for reply in replies]
    assert texts == reference["structured"]
    fact = json.loads(texts[0])  # the grammar held on every rank: the schema's JSON, not free text
    assert fact["name"] in ("fox", "dog", "river") and fact["count"] in (1, 2, 3), texts[0]
    assert not group.health().json()["group"]["failed"]


def test_an_adapter_is_refused_as_unsupported_in_group(group: Group) -> None:
    """A LoRA adapter that fits the model is refused with the documented 400 unsupported_in_group, per request
    and when registered (a TP shard's layers used to fail the adapter's shape check: adapter_incompatible, which
    blames the adapter); the group keeps serving."""
    base = group.frontend.base_url
    r = httpx.post(f"{base}/v1/chat/completions", json=chat("default", "hi", stream=False, adapter_path=ADAPTER),
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_in_group", r.text
    r = httpx.post(f"{base}/v1/adapters", json={"name": "grouped", "path": ADAPTER}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_in_group", r.text
    assert httpx.get(f"{base}/v1/adapters", timeout=10).json()["data"] == []  # nothing registered
    assert not group.health().json()["group"]["failed"]


def test_a_lost_rank_fails_the_group_and_every_stream(group: Group) -> None:
    """TP: kill -9 of rank 1 mid-stream; PP: SIGSTOP of rank 1 (the watchdog's case). Breaks the group."""
    base = group.frontend.base_url
    rank1 = group.pids()[1]
    started = threading.Barrier(4)
    body = chat("default", "Talk for a long time.", max_tokens=4000)

    def on_chunk(n: int) -> None:
        if n == 2:
            started.wait(60)

    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream_text, base, body, on_chunk) for _ in range(3)]
        started.wait(60)
        os.kill(rank1, signal.SIGKILL if group.mode == "tp" else signal.SIGSTOP)
        results = [future.result(60) for future in streams]
    try:
        for _, events in results:
            assert "error" in events[-2] and events[-1] == {"done": True}, events[-3:]
            assert events[-2]["error"]["code"] == "engine_group_failed"
        deadline = time.monotonic() + 10
        while True:
            health = group.health()
            failure = health.json().get("group") or {}
            if failure.get("failed_rank") is not None:
                break
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        assert health.status_code == 503 and health.json()["status"] == "group_failed"
        assert failure["failed_rank"] == 1
        print(f"\n{group.mode} group failure as /health reports it: {failure}")
        # Engine-measured: from the last step every rank finished to the error events.
        limit = 3.0 if group.mode == "tp" else STEP_TIMEOUT + 1.0
        assert failure["streams_failed_after_s"] <= limit, failure
        r = httpx.post(f"{base}/v1/chat/completions", json=chat("default", "hi", stream=False), timeout=10)
        assert r.status_code == 503
        # Then rank 0 exits 75 (EX_TEMPFAIL) for mlx.launch or the service units to restart the group.
        deadline = time.monotonic() + EXIT_DELAY + 10
        while "Node with rank 0 exited with code 75" not in group.launch.log():
            assert time.monotonic() < deadline, group.launch.log()[-3000:]
            time.sleep(0.2)
    finally:
        _kill_quietly(rank1, signal.SIGKILL)


def test_ranks_started_by_service_units_stop_cleanly_with_rank_0(group_model: Path, ipc_dir: Path,
                                                                tmp_path: Path) -> None:
    """No mlx.launch: MLX_RANK + MLX_HOSTFILE set by hand, as deploy/groups.md's units do. SIGTERM to rank 0
    sends the followers a stop plan: every rank exits 0 (a supervisor sees a clean stop, not a failure)."""
    port = _group_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    endpoint = f"ipc://{ipc_dir}/grp-units.sock"
    ranks = [Engine(endpoint, tmp_path / f"rank{rank}.log", model=str(group_model), args=["--group", "pp"],
                    env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}) for rank in (0, 1)]
    try:
        pong = ranks[0].wait_ready()
        assert pong["state"] == "ready"
        ranks[0].signal(signal.SIGTERM)
        assert [rank.popen.wait(30) for rank in ranks] == [0, 0], [rank.log()[-2000:] for rank in ranks]
        assert "rank 0 stopped the group" in ranks[1].log()
    finally:
        for rank in ranks:
            rank.stop()


def test_a_rank_on_other_weights_never_comes_up_healthy(group_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """Rank 1 started on another directory holding the same architecture with other weights: every rank shards
    and runs, so this used to come up healthy and fail only at the first token checksum, after serving. Rank 0
    compares the ranks' weights digests (reported in their heartbeats) before it goes ready: /health answers
    503 group_failed naming rank 1 and why, requests are refused, and rank 0 exits 75."""
    from model_builders.text import build_model

    other = build_model(tmp_path / "tiny-group-other", size="tiny-group", seed=1)
    port = _group_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    endpoint = f"ipc://{ipc_dir}/grp-weights.sock"
    ranks = [Engine(endpoint, tmp_path / f"rank{rank}.log", model=str(model),
                    args=["--group", "tp", "--group-exit-delay", str(EXIT_DELAY)],
                    env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
             for rank, model in ((0, group_model), (1, other))]
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=1)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                health = httpx.get(f"{frontend.base_url}/health", timeout=5)
            except httpx.HTTPError:
                health = None
            assert health is None or health.status_code != 200, health.text  # never healthy, not for a moment
            if health is not None and (health.json().get("group") or {}).get("failed"):
                break
            assert ranks[0].popen.poll() is None, ranks[0].log()[-3000:]
            assert time.monotonic() < deadline, ranks[0].log()[-3000:]
            time.sleep(0.1)
        group = health.json()["group"]
        assert health.status_code == 503 and health.json()["status"] == "group_failed"
        assert group["failed_rank"] == 1 and "loaded other weights than rank 0" in group["reason"], group
        digests = [rank.get("weights_digest") for rank in group["ranks"]]
        assert all(digests) and digests[0] != digests[1], group["ranks"]
        assert "loaded other weights than rank 0" in ranks[0].log()
        assert "engine group ready" not in ranks[0].log()
        r = httpx.post(f"{frontend.base_url}/v1/chat/completions", json=chat("default", "hi", stream=False),
                       timeout=10)
        assert r.status_code == 503, r.text
        assert ranks[0].popen.wait(EXIT_DELAY + 15) == 75, ranks[0].log()[-3000:]
    finally:
        _stop_group(frontend, ranks)


def _stop_group(frontend: Frontend, ranks: list[Engine]) -> None:
    frontend.stop()
    for rank in ranks:
        if rank.popen.poll() is None:
            _kill_quietly(rank.pid, signal.SIGKILL)
        rank.stop()


def test_a_slow_prefill_step_is_not_a_hung_rank(group_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """Rank 1's step that starts a prefill takes 3 s (fault injection, as a long chunk on a slow rank does) under
    --group-step-timeout 1: every rank's heartbeats say it is alive and inside the step, so the watchdog waits
    (the step prefills ~300 tokens: up to 1 × (1 + 300/64) s) instead of failing a healthy group as "a rank
    hangs". The request completes and the group stays up."""
    port = _group_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    endpoint = f"ipc://{ipc_dir}/grp-slow.sock"
    ranks = [Engine(endpoint, tmp_path / f"rank{rank}.log", model=str(group_model),
                    args=["--group", "tp", "--group-step-timeout", "1", "--group-exit-delay", "1"],
                    env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "MLX_ENGINE_FAULT_INJECTION": "1",
                         "MLX_ENGINE_DEBUG_GROUP_PREFILL_SECONDS": "3"})
             for rank in (0, 1)]
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=1)
    try:
        frontend.wait_healthy(90)
        reply = _completion(frontend.base_url, SHARED * 2 + "What floats?")
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS, reply
        assert "fault injection: rank 1's step" in ranks[1].log()  # the slow step happened
        info = httpx.get(f"{frontend.base_url}/health", timeout=10).json()["group"]
        assert not info["failed"] and info["slow_steps"] >= 1, info
        assert "slow, not hung" in ranks[0].log() and "engine group failed" not in ranks[0].log()
    finally:
        _stop_group(frontend, ranks)


class _Unit(threading.Thread):
    """One rank's service unit as deploy/groups.md's systemd unit runs it (`Restart=always`, `RestartSec=1`;
    launchd's `KeepAlive`): a rank that exits for any reason (75 after a group failure, killed by a
    signal, 0 after rank 0 stopped the group) is started again with the same command until the test
    stops the unit."""

    def __init__(self, rank: int, endpoint: str, model: Path, hostfile: Path, logs: Path):
        super().__init__(name=f"unit-rank{rank}", daemon=True)
        self.rank, self.endpoint, self.model, self.hostfile, self.logs = rank, endpoint, model, hostfile, logs
        self.starts: list[Engine] = []
        self.exit_codes: list[int] = []
        self.halt = threading.Event()
        self._start()

    def _start(self) -> None:
        self.starts.append(Engine(self.endpoint, self.logs / f"rank{self.rank}-{len(self.starts)}.log",
                                  model=str(self.model),
                                  args=["--group", "tp", "--group-step-timeout", str(STEP_TIMEOUT),
                                        "--group-exit-delay", "1"],
                                  env={"MLX_RANK": str(self.rank), "MLX_HOSTFILE": str(self.hostfile)}))

    @property
    def current(self) -> Engine:
        return self.starts[-1]

    def run(self) -> None:
        while not self.halt.is_set():
            code = self.current.popen.poll()
            if code is None:
                time.sleep(0.05)
                continue
            self.exit_codes.append(code)
            if self.halt.is_set():
                return
            time.sleep(1.0)  # RestartSec
            if not self.halt.is_set():
                self._start()

    def stop(self) -> None:
        self.halt.set()
        self.join(5)
        for engine in self.starts:
            if engine.popen.poll() is None:
                _kill_quietly(engine.pid, signal.SIGKILL)
            engine.stop()


def test_units_restart_a_failed_group_and_the_same_frontend_reconnects(group_model: Path, ipc_dir: Path,
                                                                       tmp_path: Path, reference: dict) -> None:
    """kill -9 of rank 1 under `Restart=always` units: rank 0 fails the group and exits 75, both units
    restart their rank, the ranks meet again, and the front-end that was never restarted serves the new
    engine (a new epoch) through the official SDK with the same greedy text as one process."""
    from openai import OpenAI

    port = _group_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    endpoint = f"ipc://{ipc_dir}/grp-restart.sock"
    units = [_Unit(rank, endpoint, group_model, hostfile, tmp_path) for rank in (0, 1)]
    for unit in units:
        unit.start()
    frontend = Frontend(endpoint, tmp_path / "frontend.log", workers=1)
    client = OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

    def healthy(timeout: float) -> dict:
        try:
            return frontend.wait_healthy(timeout)
        except TimeoutError as exc:  # the ranks' logs say why, not the front-end's
            raise AssertionError([unit.current.log()[-3000:] for unit in units]) from exc

    def complete() -> str:
        reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPTS[1]}],
                                               max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
        return reply.choices[0].message.content

    try:
        first = healthy(90)
        assert complete() == reference["greedy"][1]
        killed = time.monotonic()
        os.kill(units[1].current.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # the same front-end, never restarted, sees the restarted group's new epoch
            health = healthy(max(1.0, deadline - time.monotonic()))
            if health["engine"]["epoch"] != first["engine"]["epoch"]:
                break
            time.sleep(0.2)
        assert units[0].exit_codes[:1] == [75], units[0].current.log()[-3000:]  # EX_TEMPFAIL: restart me
        assert units[1].exit_codes[:1] == [-signal.SIGKILL]
        assert len(units[0].starts) >= 2 and len(units[1].starts) >= 2
        assert health["group"]["size"] == 2 and not health["group"]["failed"]
        assert complete() == reference["greedy"][1]
        print(f"\nkill -9 of rank 1 to a completion through the same front-end: {time.monotonic() - killed:.1f} s "
              f"(report only; rank 0 exited {units[0].exit_codes}, rank 1 {units[1].exit_codes})")
    finally:
        frontend.stop()
        for unit in units:
            unit.stop()
