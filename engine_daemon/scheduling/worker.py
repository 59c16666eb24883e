"""The mlx thread: the only thread that touches MLX (model, tokenizer, KV cache).

MLX streams belong to the thread that made them, so every model call runs here.
The io thread hands in plain Python commands through a queue; results go back
as encoded frames through an inproc PUSH socket the io thread polls.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

import mlx.core as mx

from engine_daemon.scheduling.batch import BatchScheduler
from engine_daemon.models.manager import ModelManager
from engine_daemon.request.admission import RequestError
from engine_daemon.scheduling.base import BaseScheduler, Event, SchedulerConfig, SerialScheduler
from engine_daemon.calls.tokenize import detokenize, tokenize
from protocol import MsgType, encode

log = logging.getLogger(__name__)

# Set to 1 (tests only) to enable CALLs that deliberately wedge the engine.
FAULT_INJECTION_ENV = "MLX_ENGINE_FAULT_INJECTION"


@dataclass
class EngineStatus:
    """What the io thread reports without asking the mlx thread (plain values, GIL-safe)."""

    state: str = "idle"  # idle | loading | ready | draining
    model: str | None = None
    model_kind: str | None = None  # "text" | "vision" | "audio" (engine_daemon/model_store.kind_of_config)
    queued: int = 0
    running: int = 0
    steps: int = 0
    last_step_at: float = 0.0
    # monotonic time the mlx thread started its current piece of work; 0 while it waits for work
    busy_since: float = 0.0


def make_scheduler(models: ModelManager, config: SchedulerConfig) -> BaseScheduler:
    """Continuous batching, unless the KV options ask for something mlx-lm cannot batch."""
    if config.kv_bits:
        log.warning("--kv-bits %d: mlx-lm cannot batch a quantized KV cache, so requests run one at a time "
                    "(serial scheduler). Drop --kv-bits to batch.", config.kv_bits)
        return SerialScheduler(models, config)
    return BatchScheduler(models, config)


class MlxWorker(threading.Thread):
    """Drains commands, runs scheduler steps, emits frames; never blocks on a socket."""

    def __init__(self, context: zmq.Context, outbox_address: str, config: SchedulerConfig,
                 preload: str | None = None):
        super().__init__(name="mlx", daemon=True)
        self.commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.status = EngineStatus()
        self.models = ModelManager(trust_remote_code=config.trust_remote_code, names=config.names)
        self.scheduler = make_scheduler(self.models, config)
        self._context = context
        self._outbox_address = outbox_address
        self._preload = preload
        self._stopping = threading.Event()
        self._idle_unload = config.idle_unload  # --idle-unload seconds, None: keep the model
        self._last_active = time.monotonic()

    def stop(self) -> None:
        self._stopping.set()
        self.commands.put(("stop",))

    def run(self) -> None:
        outbox = self._context.socket(zmq.PUSH)
        outbox.setsockopt(zmq.LINGER, 0)
        outbox.connect(self._outbox_address)
        self.scheduler.stream = mx.default_stream(mx.default_device())
        try:
            if self._preload:
                self._load(self._preload)
            while not self._stopping.is_set():
                events = self._drain_commands(block=not self.scheduler.has_work())
                if self.scheduler.has_work():
                    self._mark_busy()
                    self.status.busy_since = self.status.busy_since or time.monotonic()
                    events += self._step()
                    self.status.steps += 1
                    self.status.last_step_at = time.monotonic()
                self._publish(outbox, events)
                self._update_status()
                self._unload_if_idle()
                self.status.busy_since = 0.0
        except Exception:
            log.exception("mlx thread crashed")
            raise
        finally:
            outbox.close()

    def _step(self) -> list[Event]:
        """One scheduler step; a bug in it fails the requests in flight, never the thread."""
        try:
            return self.scheduler.step()
        except Exception:
            log.exception("scheduler step failed: failing every request in flight")
            return self.scheduler.fail_all(500, "engine_error", "The engine hit an internal error")

    def _load(self, name: str) -> None:
        self.status.state = "loading"
        try:
            self.models.ensure(self.scheduler.resolve_model(name))
            self.scheduler.adapters.warm(self.models.current)  # --adapter-path: checked against the model now
            if getattr(self.scheduler, "speculative", None) is not None:  # --draft-model: loaded and checked now
                self.scheduler.speculative.draft_for(self.models.current)
        except Exception:
            log.exception("could not preload model %s", name)
        self._update_status()
        self._last_active = time.monotonic()  # --idle-unload counts from the end of the preload

    def _unload_if_idle(self) -> None:
        """--idle-unload: frees the model once no command or request has come for that long.

        Any work of this loop turn (a command, a scheduler step, a load) counts as use;
        the next request after an unload loads the model again.
        """
        if self.status.busy_since or self.scheduler.has_work():
            self._last_active = time.monotonic()
            return
        current = self.models.current
        if not self._idle_unload or current is None:
            return
        idle = time.monotonic() - self._last_active
        if idle >= self._idle_unload:
            log.info("model %s unused for %.0f s (--idle-unload %g): unloading it", current.ref.id, idle,
                     self._idle_unload)
            self.scheduler.reset()  # the generator and prompt cache hold on to the model
            self.models.unload()
            self._update_status()

    def _mark_busy(self) -> None:
        if self.scheduler.waiting:
            ref = self.scheduler.waiting[0][1]
            current = self.models.current
            if current is None or current.ref != ref:
                self.status.state = "loading"

    def _update_status(self) -> None:
        current = self.models.current
        self.status.model = current.ref.id if current else None
        self.status.model_kind = current.kind if current else None
        self.status.queued = self.scheduler.queued()
        self.status.running = self.scheduler.running()
        self.status.state = "ready" if current else "idle"

    def _drain_commands(self, block: bool) -> list[Event]:
        """Handles every waiting command; waits up to 0.5 s for one only when idle."""
        events: list[Event] = []
        try:
            command = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return events
        self.status.busy_since = self.status.busy_since or time.monotonic()
        while True:
            try:
                events += self._handle(command)
            except Exception:
                log.exception("command %s failed", command[0])
                events += self._refuse_failed(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return events

    @staticmethod
    def _refuse_failed(command: tuple[Any, ...]) -> list[Event]:
        """Answers the sender of a command that raised, so no client waits forever."""
        kind = command[0]
        if kind == "add":
            _, peer, body = command
            return [(peer, MsgType.ERROR, {"rid": body["rid"], "status": 500, "code": "engine_error",
                                           "message": "The engine could not take this request",
                                           "type": "server_error"})]
        if kind == "call":
            _, peer, cid, method, _ = command
            return [(peer, MsgType.ERROR, {"cid": cid, "status": 500, "code": "engine_error",
                                           "message": f"CALL {method} failed", "type": "server_error"})]
        return []

    def _handle(self, command: tuple[Any, ...]) -> list[Event]:
        kind = command[0]
        if kind == "add":
            _, peer, body = command
            return self.scheduler.submit(peer, body)
        if kind == "abort":
            _, rids, reason = command
            found = self.scheduler.abort(set(rids))
            if found:
                log.info("aborted %d request(s) (%s): rid=%s", found, reason, ",".join(rids))
            return []
        if kind == "peer_gone":
            found = self.scheduler.abort_peer(command[1])
            if found:
                log.info("aborted %d request(s) of a vanished front-end", found)
            return []
        if kind == "call":
            _, peer, cid, method, args = command
            try:
                events, result = self._call(method, args)
            except RequestError as exc:  # a refusal the client should see (400 and the like), not a crash
                return [(peer, MsgType.ERROR, {**exc.to_body(None), "cid": cid})]
            return events + [(peer, MsgType.RESULT, {"cid": cid, "result": result})]
        return []

    def _call(self, method: str, args: dict[str, Any]) -> tuple[list[Event], Any]:
        """CALLs that change model state or use the tokenizer (MLX objects belong to this thread)."""
        if method == "unload":
            events = self.scheduler.fail_all(503, "model_unloaded", "The model was unloaded")
            return events, {"status": "success" if self.models.unload() else "no_model_loaded"}
        if method == "adapters.add":  # the adapter registry (engine_daemon/lora/adapters.py); adapters.list: io thread
            return [], self.scheduler.adapters.add(args, self.models.current)
        if method == "adapters.remove":
            return [], self.scheduler.adapters.remove(args)
        if method == "tokenize":
            return [], tokenize(self.models.current, args)
        if method == "detokenize":
            return [], detokenize(self.models.current, args)
        if method == "debug_sleep" and os.environ.get(FAULT_INJECTION_ENV) == "1":
            # Fault injection for tests: wedge the mlx thread as a runaway kernel would.
            log.warning("fault injection: mlx thread sleeps %.1f s", args.get("seconds", 1.0))
            time.sleep(float(args.get("seconds", 1.0)))
            return [], {"slept": args.get("seconds", 1.0)}
        return [], {"error": f"unknown method {method}"}

    def _publish(self, outbox: zmq.Socket, events: list[Event]) -> None:
        """One DELTAS frame per peer per step; every other event is its own frame."""
        deltas: dict[bytes, list[dict[str, Any]]] = {}
        for peer, msg_type, body in events:
            if msg_type == MsgType.DELTAS:
                deltas.setdefault(peer, []).append(body)
            else:
                outbox.send_multipart([peer, encode(msg_type, body)])
        for peer, items in deltas.items():
            outbox.send_multipart([peer, encode(MsgType.DELTAS, {"items": items})])
