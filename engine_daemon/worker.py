"""The mlx thread: the only thread that touches MLX (model, tokenizer, KV cache).

MLX streams belong to the thread that made them, so every model call runs here.
The io thread hands in plain Python commands through a queue; results go back
as encoded frames through an inproc PUSH socket the io thread polls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

import mlx.core as mx

from engine_daemon.batch_scheduler import BatchScheduler
from engine_daemon.model_manager import ModelManager
from engine_daemon.scheduler import BaseScheduler, Event, SchedulerConfig, SerialScheduler
from protocol import MsgType, encode

log = logging.getLogger(__name__)


@dataclass
class EngineStatus:
    """What the io thread reports without asking the mlx thread (plain values, GIL-safe)."""

    state: str = "idle"  # idle | loading | ready | draining
    model: str | None = None
    queued: int = 0
    running: int = 0
    steps: int = 0
    last_step_at: float = 0.0


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
        self.models = ModelManager()
        self.scheduler = make_scheduler(self.models, config)
        self._context = context
        self._outbox_address = outbox_address
        self._preload = preload
        self._stopping = threading.Event()

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
                    events += self.scheduler.step()
                    self.status.steps += 1
                    self.status.last_step_at = time.monotonic()
                self._publish(outbox, events)
                self._update_status()
        except Exception:
            log.exception("mlx thread crashed")
            raise
        finally:
            outbox.close()

    def _load(self, name: str) -> None:
        self.status.state = "loading"
        try:
            self.models.ensure(self.scheduler.resolve_model(name))
        except Exception:
            log.exception("could not preload model %s", name)
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
        while True:
            events += self._handle(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return events

    def _handle(self, command: tuple[Any, ...]) -> list[Event]:
        kind = command[0]
        if kind == "add":
            _, peer, body = command
            return self.scheduler.submit(peer, body)
        if kind == "abort":
            _, rids, reason = command
            found = self.scheduler.abort(set(rids))
            if found:
                log.info("aborted %d request(s) (%s): %s", found, reason, ", ".join(rids))
            return []
        if kind == "peer_gone":
            found = self.scheduler.abort_peer(command[1])
            if found:
                log.info("aborted %d request(s) of a vanished front-end", found)
            return []
        if kind == "call":
            _, peer, cid, method, args = command
            events, result = self._call(method, args)
            return events + [(peer, MsgType.RESULT, {"cid": cid, "result": result})]
        return []

    def _call(self, method: str, args: dict[str, Any]) -> tuple[list[Event], Any]:
        """CALLs that change model state; read-only ones are answered by the io thread."""
        if method == "unload":
            events = self.scheduler.fail_all(503, "model_unloaded", "The model was unloaded")
            self.scheduler.on_unload()
            return events, {"status": "success" if self.models.unload() else "no_model_loaded"}
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
