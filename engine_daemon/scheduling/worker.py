"""The mlx thread: the only thread that touches MLX (model, tokenizer, KV cache).

MLX streams belong to the thread that made them, so every model call runs here.
The io thread hands in plain Python commands through a queue; results go back
as encoded frames through an inproc PUSH socket the io thread polls.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import zmq

from engine_daemon.auxiliary.jobs import AuxiliaryQueue
from engine_daemon.auxiliary.slots import AuxiliarySlots
from engine_daemon.config import SchedulerConfig
from engine_daemon.errors import RequestError
from engine_daemon.group.settings import GroupSettings
from engine_daemon.models.manager import ModelManager
from engine_daemon.scheduling.base import BaseScheduler, Event
from engine_daemon.scheduling.batch import BatchScheduler
from engine_daemon.scheduling.commands import (
    AbortCommand,
    AddCommand,
    AuxiliaryCommand,
    AuxiliaryReadyCommand,
    CallCommand,
    Command,
    PeerGoneCommand,
    ReplyCommand,
    StopCommand,
)
from engine_daemon.scheduling.frames import encode_events
from engine_daemon.scheduling.group_leader import GroupLeader
from engine_daemon.scheduling.inbox import MAX_COMMANDS_PER_STEP, PendingAborts, shutdown_events
from engine_daemon.scheduling.serial import SerialScheduler
from protocol import MsgType

log = logging.getLogger(__name__)


@dataclass
class EngineStatus:
    """What the io thread reports without asking the mlx thread (plain values, GIL-safe)."""

    state: str = "idle"  # idle | loading | ready | draining
    model: str | None = None
    model_kind: str | None = None  # "text" | "vision" | "audio" (`engine_daemon.models.store.model_kind`)
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
                 preload: str | None = None, group: tuple[GroupSettings, object] | None = None):
        super().__init__(name="mlx", daemon=True)
        self.commands: queue.Queue[Command] = queue.Queue()
        self.status = EngineStatus()
        settings, mx_group = group if group is not None else (None, None)
        self.models = ModelManager(trust_remote_code=config.trust_remote_code, names=config.names, group=mx_group,
                                   group_mode=settings.mode if settings else None)
        self.scheduler = make_scheduler(self.models, config)
        # Rank 0 of an engine group (`engined --group`): plans, control socket, watchdog, faults.
        self.group = (GroupLeader(settings, mx_group, context, outbox_address, self.scheduler)
                      if settings is not None else None)
        self._context = context
        self._outbox_address = outbox_address
        self._preload = preload
        self._stopping = threading.Event()
        self._idle_unload = config.idle_unload  # --idle-unload seconds, None: keep the model
        self._last_active = time.monotonic()
        # Embedding / transcription / speech models beside the generation model, and their jobs.
        self.aux = AuxiliarySlots(
            config.names, roots=config.model_dirs, allow_download=config.allow_download,
            memory_budget_bytes=config.memory_budget_bytes, preload=config.auxiliary_models,
            main_weight_bytes=lambda: self.models.current.weights_bytes if self.models.current else 0)
        self.aux_jobs = AuxiliaryQueue(config.aux_step_tokens)
        self._preparing: set[Any] = set()  # auxiliary jobs on the admission pool (what they hold counts too)
        # Seconds between consecutive steps while requests decode (`_time_step`); read by CALL step_gaps.
        self.step_gaps: deque[float] = deque(maxlen=4096)
        self.step_gap_count = 0
        self._step_seconds: deque[float] = deque(maxlen=32)  # recent scheduler steps (`_decode_seconds`)
        # Runs a job's `prepare` off this thread, then `answer(result, error)`: the engine's admission
        # pool (`Preprocessor.run_call`); None (tests): in line.
        self.offload: Callable[[Callable[[], Any], Callable[[Any, RequestError | None], None]], None] | None = None

    def stop(self) -> None:
        self._stopping.set()
        self.commands.put(StopCommand())

    def run(self) -> None:
        outbox = self._context.socket(zmq.PUSH)
        outbox.setsockopt(zmq.LINGER, 0)
        outbox.connect(self._outbox_address)
        self.scheduler.stream = mx.default_stream(mx.default_device())
        try:
            if self._preload:
                self._load(self._preload)
            if self.group is not None:
                self._attach_group()
            self._preload_auxiliary()
            while not self._stopping.is_set():
                idle = not (self.scheduler.has_work() or self.aux_jobs.has_work())
                events = self._drain_commands(block=idle)
                if idle and self.scheduler.has_work():
                    events += self._coalesce()
                if self.group is not None and self.group.failed:
                    self._publish(outbox, events)
                    continue  # no more steps: the process exits after --group-exit-delay
                if self.scheduler.has_work():
                    self._mark_busy()
                    self.status.busy_since = self.status.busy_since or time.monotonic()
                    started = time.perf_counter()
                    events += self._step()
                    if self.status.running:
                        self._step_seconds.append(time.perf_counter() - started)
                    self.status.steps += 1
                    self._time_step(time.monotonic())
                    events += self._group_after_tick()
                if self.aux_jobs.has_work():  # one bounded slice between two generation steps
                    self.status.busy_since = self.status.busy_since or time.monotonic()
                    events += self.aux_jobs.tick(self._decode_seconds())
                self._publish(outbox, events)
                self._after_publish()
                self._update_status()
                self._unload_if_idle()
                self.status.busy_since = 0.0
            if self.group is not None:
                self.group.stop()
            self._publish(outbox, shutdown_events(self.scheduler, self.aux_jobs, self.commands))
            outbox.setsockopt(zmq.LINGER, 2000)  # those last frames reach the io thread (`wind_down`)
            try:
                self.scheduler.on_shutdown()
                # The model is freed with the process: what holds on to it lets go, and a vision
                # generator writes its hot prefixes to --prompt-cache-dir as it closes (`TieredAPCManager`).
                self.scheduler.on_unload()
            except Exception:
                log.exception("saving the prompt cache at shutdown failed")
        except BaseException:
            # The io thread sees the thread gone and stops the engine with a non-zero exit, so a
            # supervisor restarts it (a live process with a dead mlx thread would hang every stream).
            log.critical("mlx thread crashed", exc_info=True)
            raise
        finally:
            outbox.close()
            # This thread's MLX streams (the default one, `cpu_parallel`'s and `cache_join`'s) each own a
            # thread of MLX's: left to thread or process teardown they were destroyed there and the
            # engine sometimes aborted on SIGTERM after "engine stopped" (std::terminate, exit -6).
            clear_streams = getattr(mx, "clear_streams", None)  # MLX 0.31 and later
            if clear_streams is not None:
                clear_streams()

    def _step(self) -> list[Event]:
        """One scheduler step; a bug in it fails the requests in flight, never the thread."""
        try:
            return self.scheduler.step()
        except Exception as exc:
            if self.group is not None:  # one rank failing a step leaves the others out of step: the group fails
                log.exception("group step failed")
                return self.group.failed_events(exc)
            log.exception("scheduler step failed: failing every request in flight")
            return self.scheduler.fail_all(500, "engine_error", "The engine hit an internal error")

    def _after_publish(self) -> None:
        """The scheduler's deferred work of the step just sent (`BaseScheduler.after_publish`), kept off the tokens."""
        try:
            self.scheduler.after_publish()
        except Exception:
            log.exception("work after a step failed")  # a prefix not shared costs a prefill, never the requests

    def _attach_group(self) -> None:
        current = self.models.current
        if current is None:  # the followers are told (and exit); /health says so until rank 0 exits 75
            self.group.refuse("the group's model did not load on rank 0", 0)
            return
        if current.profile.context_overflow == "summarize":
            # A summary would run the model on rank 0 alone, outside any plan: its collectives would wait forever.
            log.warning("--context-overflow summarize is not available in an engine group: truncating instead")
            current.profile = dataclasses.replace(current.profile, context_overflow="truncate")
        self.group.attach(self.scheduler.stream, current.weights_bytes)

    def _group_after_tick(self) -> list[Event]:
        if self.group is None:
            return []
        try:
            self.group.after_tick()
        except Exception as exc:
            return self.group.failed_events(exc)
        return []

    def _load(self, name: str) -> None:
        self.status.state = "loading"
        try:
            self.models.ensure(self.scheduler.resolve_model(name))
            self.scheduler.adapters.warm(self.models.current)  # --adapter-path: checked against the model now
            if self.scheduler.speculative is not None:  # --draft-model: loaded and checked now
                self.scheduler.speculative.draft_for(self.models.current)
        except Exception as exc:
            if self.group is not None and self.group.failed:  # refused mid-load: the told followers left its collective
                log.warning("model %s not loaded: the group was refused during the load (%s)", name, exc)
            else:
                log.exception("could not preload model %s", name)
        self._update_status()
        self._last_active = time.monotonic()  # --idle-unload counts from the end of the preload

    def _decode_seconds(self) -> float | None:
        """A decode step's cost while requests decode (the scheduler's pacer measures it), else None."""
        if not self.scheduler.running():
            return None
        measured = getattr(getattr(self.scheduler, "pacer", None), "decode_seconds", None)
        if measured is None and self._step_seconds:
            measured = sorted(self._step_seconds)[len(self._step_seconds) // 2]  # the median recent step
        return measured

    def _time_step(self, now: float) -> None:
        """Records the gap since the previous step when requests ran across both: a running stream's ITL.

        With requests decoding, every step gives each of them a token, so these gaps are the
        engine's own per-token timing (what an auxiliary slice between two steps adds shows here).
        """
        if self.status.running and self.status.last_step_at and now - self.status.last_step_at < 5.0:
            self.step_gaps.append(now - self.status.last_step_at)
            self.step_gap_count += 1
        self.status.last_step_at = now

    def _preload_auxiliary(self) -> None:
        """--embedding-model and the like: loaded at start; a failure is logged, the engine serves on."""
        for kind, name in self.aux.preload.items():
            try:
                self.aux.get(kind, name)
            except Exception:
                log.exception("could not preload %s model %s", kind, name)
        self._last_active = time.monotonic()

    def _unload_if_idle(self) -> None:
        """--idle-unload: frees the model once no command or request has come for that long.

        Any work of this loop turn (a command, a scheduler step, a load) counts as use;
        the next request after an unload loads the model again.
        """
        if self.status.busy_since or self.scheduler.has_work() or self.aux_jobs.has_work():
            self._last_active = time.monotonic()
            return
        self.aux.unload_idle(time.monotonic(), self._idle_unload)  # each auxiliary model by its own last use
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
        """Handles the waiting commands, at most `MAX_COMMANDS_PER_STEP`, consecutive ABORTs merged into one
        (`inbox`); waits up to 0.5 s for one only when idle."""
        events: list[Event] = []
        try:
            command = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return events
        self.status.busy_since = self.status.busy_since or time.monotonic()
        aborts = PendingAborts()
        for taken in range(1, MAX_COMMANDS_PER_STEP + 1):
            if isinstance(command, AbortCommand):
                aborts.add(command)
            else:
                aborts = aborts.apply(self.scheduler, self.aux_jobs)  # first: what follows sees them done
                events += self._handle_safely(command)
            if taken == MAX_COMMANDS_PER_STEP:
                break  # the rest wait for the next step: running streams keep their pace
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
        aborts.apply(self.scheduler, self.aux_jobs)
        return events

    def _coalesce(self) -> list[Event]:
        """Takes the requests arriving right behind the one that woke the idle engine (`--coalesce-ms`).

        Waits until a window passes with no new command, three windows at most, and only while the
        waiting prefill is long enough to be worth it (`BaseScheduler.worth_coalescing`).
        """
        window = self.scheduler.config.coalesce_seconds
        if self.group is not None or not self.scheduler.worth_coalescing(window):
            return []
        events: list[Event] = []
        self.scheduler.stats.coalesce_waits += 1
        deadline = time.monotonic() + 3 * window
        while (left := deadline - time.monotonic()) > 0:
            try:
                command = self.commands.get(timeout=min(window, left))
            except queue.Empty:
                break
            self.scheduler.stats.coalesced_requests += isinstance(command, AddCommand)
            events += self._handle_safely(command)
        return events

    def _handle_safely(self, command: Command) -> list[Event]:
        """`_handle`; a command that raises is answered with an error instead of stopping the loop."""
        try:
            return self._handle(command)
        except Exception:
            log.exception("command %s failed", type(command).__name__)
            return self._refuse_failed(command)

    @staticmethod
    def _refuse_failed(command: Command) -> list[Event]:
        """Answers the sender of a command that raised, so no client waits forever."""
        if isinstance(command, AddCommand):
            return [(command.peer, MsgType.ERROR, {"rid": command.body["rid"], "status": 500, "code": "engine_error",
                                                   "message": "The engine could not take this request",
                                                   "type": "server_error"})]
        if isinstance(command, (CallCommand, AuxiliaryCommand)):
            return [(command.peer, MsgType.ERROR, {"cid": command.cid, "status": 500, "code": "engine_error",
                                                   "message": f"CALL {getattr(command, 'method', 'auxiliary')} failed",
                                                   "type": "server_error"})]
        return []

    def _handle(self, command: Command) -> list[Event]:
        if isinstance(command, AddCommand):
            if self.group is not None and self.group.failed:
                return [(command.peer, MsgType.ERROR, self.group.refusal(command.body["rid"]))]
            return self.scheduler.submit(command.peer, command.body, command.prepared)
        if isinstance(command, AbortCommand):
            PendingAborts(command).apply(self.scheduler, self.aux_jobs)
            return []
        if isinstance(command, PeerGoneCommand):
            found = self.scheduler.abort_peer(command.peer) + self.aux_jobs.cancel(command.peer, None)
            if found:
                log.info("aborted %d request(s) of a vanished front-end", found)
            return []
        if isinstance(command, CallCommand):
            # A handler of `engine_daemon.calls.mlx_thread`: it changes model state or uses the tokenizer.
            try:
                events, result = command.handler(self, command.args)
            except RequestError as exc:  # a refusal the client should see (400 and the like), not a crash
                return [(command.peer, MsgType.ERROR, {**exc.to_body(None), "cid": command.cid})]
            return events + [(command.peer, MsgType.RESULT, {"cid": command.cid, "result": result})]
        if isinstance(command, AuxiliaryCommand):
            return self._start_auxiliary(command)
        if isinstance(command, AuxiliaryReadyCommand):
            self._preparing.discard(command.job)
            if command.error is not None:
                return [(command.peer, MsgType.ERROR, {**command.error.to_body(None), "cid": command.cid})]
            self.aux_jobs.add(command.peer, command.cid, command.job)
            return []
        if isinstance(command, ReplyCommand):
            if command.error is not None:
                return [(command.peer, MsgType.ERROR, {**command.error.to_body(None), "cid": command.cid})]
            return [(command.peer, MsgType.RESULT, {"cid": command.cid, "result": command.result})]
        return []  # StopCommand: the loop sees _stopping

    def _check_audio_room(self, size: int) -> None:
        """429 when uploads held by queued and preparing jobs would pass --max-queued-audio-seconds (16 kHz float32)."""
        held = self.aux_jobs.held_bytes() + sum(job.held_bytes for job in self._preparing)
        limit = int(self.scheduler.config.max_queued_audio_seconds * 16_000 * 4)
        if size and held + size > limit:
            raise RequestError(429, "audio_queue_full", f"The engine holds {held // 64_000} s of queued audio; "
                               f"{size // 64_000} s more would pass its limit of {limit // 64_000} s; retry later",
                               error_type="rate_limit_error")

    def _start_auxiliary(self, command: AuxiliaryCommand) -> list[Event]:
        """Loads the job's model (its kind's slot; never the generation model) and prepares the job off-thread."""
        request = command.request
        try:
            if len(self.aux_jobs.entries) >= self.scheduler.config.max_queued:  # --max-queued bounds these too
                raise RequestError(429, "queue_full", f"The engine queue is full ({len(self.aux_jobs.entries)} "
                                   "auxiliary requests waiting); retry later", error_type="rate_limit_error")
            self._check_audio_room(len(request.args.get("audio") or b""))
            job = self.aux.get(request.kind, request.model).job(request.args)
            self._preparing.add(job)
        except RequestError as exc:
            return [(command.peer, MsgType.ERROR, {**exc.to_body(None), "cid": command.cid})]

        def answer(_: Any, error: RequestError | None) -> None:
            self.commands.put(AuxiliaryReadyCommand(command.peer, command.cid, job, error))

        if self.offload is None:
            try:
                job.prepare()
            except RequestError as exc:
                answer(None, exc)
                return []
            answer(None, None)
        else:
            self.offload(job.prepare, answer)
        return []

    def _publish(self, outbox: zmq.Socket, events: list[Event]) -> None:
        """One DELTAS frame per peer per step; every other event is its own frame.

        A request whose output cannot be encoded ends with an ERROR and leaves the batch;
        the others are sent as usual (`encode_events`).
        """
        frames, unencodable = encode_events(events)
        for peer, frame in frames:
            outbox.send_multipart([peer, frame])
        if unencodable:
            self.scheduler.abort(unencodable)
