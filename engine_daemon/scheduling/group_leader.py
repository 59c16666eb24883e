"""Rank 0's group machinery, owned by the mlx worker: control socket, lockstep, watchdog, faults.

Kept out of `MlxWorker` so a single engine carries none of it: the worker only calls
`attach` (on the mlx thread, which owns the generation stream the plans must share),
`after_tick`, `failed_events` and `stop`, and reports `describe()` in /health and /stats.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import mlx.core as mx
import zmq

from engine_daemon.group.control import ControlServer
from engine_daemon.group.faults import GroupFaults
from engine_daemon.group.lockstep import Lockstep
from engine_daemon.group.settings import GroupSettings
from engine_daemon.group.startup import check_weights, older_engine
from engine_daemon.group.watchdog import StepWatchdog
from engine_daemon.group.wire import PlanChannel
from engine_daemon.prefix_cache.planned import PlannedPrefixCache
from engine_daemon.scheduling.base import BaseScheduler, Event
from protocol import MsgType, encode

log = logging.getLogger(__name__)

FOLLOWERS_TIMEOUT = 120.0  # seconds rank 0 waits for every follower's first heartbeat after its load

GROUP_FAILED = {"status": 503, "code": "engine_group_failed", "type": "server_error"}


class GroupLeader:
    def __init__(self, settings: GroupSettings, group: Any, context: zmq.Context, outbox_address: str,
                 scheduler: BaseScheduler):
        self.settings, self.group, self.context = settings, group, context
        self.outbox_address, self.scheduler = outbox_address, scheduler
        self.control = ControlServer(context, settings.control, settings.size)
        self.faults = GroupFaults(self.control, settings.exit_delay, self._fail_streams_elsewhere,
                                  lambda: self.lockstep.last_progress if self.lockstep is not None else 0.0)
        self.control.on_lost = self._lost
        self.control.on_older = lambda rank, fields: self.refuse(older_engine(rank, fields), rank, wait=0.0)
        self.lockstep: Lockstep | None = None
        self.watchdog: StepWatchdog | None = None
        self.weights_bytes = 0
        self.control.start()

    @property
    def failed(self) -> bool:
        return self.faults.failed

    @property
    def ready(self) -> bool:
        """Every rank's weights checked (`check_weights`): before that the group serves nothing."""
        return self.lockstep is not None

    def attach(self, stream: Any, weights_bytes: int) -> None:
        """On the mlx thread, after the model loaded: plans go out on the generation stream from now on."""
        self.weights_bytes = weights_bytes
        if self.failed:  # refused while loading (a follower on an older engine): never goes ready
            return
        started = time.monotonic()
        if not self.control.wait_for_followers(FOLLOWERS_TIMEOUT):
            stale = self.control.stale_ranks()
            self.refuse(f"followers {stale} never reached the control socket {self.settings.control} in "
                        f"{FOLLOWERS_TIMEOUT:.0f} s", stale[0] if stale else None)
            return
        reason, rank = check_weights(self.scheduler.models.current, self.control, FOLLOWERS_TIMEOUT)
        if reason:  # never healthy: /health says group_failed and why until the exit (75)
            log.info("group: rank 0 refuses the group %.2f s after its load", time.monotonic() - started)
            self.refuse(reason, rank)
            return
        self.lockstep = Lockstep(PlanChannel(self.group, stream), self.control, self.settings.checksum_every)
        self.scheduler.lockstep = self.lockstep
        config = self.scheduler.config  # rank 0 decides every rank's prompt-cache lookups, inserts and evictions
        self.scheduler.prompt_cache = PlannedPrefixCache(config.prompt_cache_size, config.prompt_cache_bytes or 1 << 62,
                                                         self.lockstep.stored, self.lockstep.evicted)
        self.watchdog = StepWatchdog(self.lockstep, self.settings.step_timeout, self._hung, control=self.control)
        self.watchdog.start()
        log.info("engine group ready: %d ranks, %s over %s", self.settings.size, self.settings.mode,
                 self.settings.backend)

    def refuse(self, reason: str, rank: int | None = None, wait: float = 1.0) -> None:
        """A start-up verdict (other weights, an older engine, a rank missing): every follower is told why over
        the control socket and exits at once (rank 0 never sends them a plan, so they must not wait on a
        collective); rank 0 reports it in /health as group_failed until its own exit (75). `wait`: how long
        to wait for the control thread to send it (0 on that thread)."""
        if not self.control.refuse(reason, wait) and wait:
            log.warning("group: the control thread did not send the refusal within %.0f s", wait)
        self.faults.fail(reason, rank)

    def after_tick(self) -> None:
        """Nothing left to run: the followers go back to their idle wait (no busy collective)."""
        if self.lockstep is not None and not self.scheduler.has_work():
            self.lockstep.go_idle()

    def failed_events(self, error: Exception) -> list[Event]:
        """The mlx thread saw the group fail: every open request ends now; the process exits soon."""
        message = f"The engine group failed ({error}); it restarts, retry the request"
        events = self.scheduler.fail_all(503, "engine_group_failed", message)
        self.faults.fail(str(error), streams_failed=True)
        return events

    def refusal(self, rid: str) -> dict[str, Any]:
        return {**GROUP_FAILED, "rid": rid, "message": "The engine group failed; it restarts, retry the request"}

    def stopping(self) -> None:
        self.control.stopping = True

    def stop(self) -> None:
        """A clean shutdown: followers leave their loops and exit 0."""
        self.control.stopping = True
        if self.watchdog is not None:
            # Followers already gone (the whole group got SIGTERM) would leave the stop plan waiting in its
            # collective: the watchdog, shortened, still bounds it.
            self.watchdog.timeout = min(self.watchdog.timeout, 5.0)
        if self.lockstep is not None and not self.failed:
            try:
                self.lockstep.stop()
            except Exception:
                log.exception("could not tell the followers to stop")
        if self.watchdog is not None:
            self.watchdog.stop()
        self.control.stop()

    def _lost(self, rank: int | None) -> None:
        if rank is None:
            self.faults.fail("a follower rank's connection closed (its process is gone)")
        else:
            self.faults.fail(f"rank {rank} stopped sending heartbeats", rank)

    def _hung(self, waited: float) -> None:
        what, rank = self.watchdog.verdict if self.watchdog is not None else ("a rank hangs", None)
        self.faults.fail(f"a step ran {waited:.1f} s, past --group-step-timeout {self.settings.step_timeout:g} s: "
                         f"{what}", rank)

    def _fail_streams_elsewhere(self, reason: str) -> None:
        """From the watchdog's or the control thread: the mlx thread may be stuck inside a collective."""
        requests = self.scheduler.all_requests()
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self.outbox_address)
        try:
            for request in requests:
                body = {**GROUP_FAILED, "rid": request.rid,
                        "message": f"The engine group failed ({reason}); it restarts, retry the request"}
                sock.send_multipart([request.peer, encode(MsgType.ERROR, body)])
        finally:
            sock.close()
        log.critical("failed %d open request(s): %s", len(requests), reason)

    def describe(self) -> dict[str, Any]:
        current = self.scheduler.models.current
        ranks = [{"rank": 0, "weights_bytes": self.weights_bytes, "active_bytes": mx.get_active_memory(),
                  "pid": os.getpid(), "weights_digest": current.weights_digest if current else None}]
        ranks += [{"rank": rank, **self.control.reports.get(rank, {})} for rank in range(1, self.settings.size)]
        return {**self.settings.describe(), "failed": self.failed, "checked": self.ready,
                **(self.faults.failure or {}),
                "ranks": ranks, **(self.lockstep.stats() if self.lockstep is not None else {}),
                # steps past --group-step-timeout that every rank was alive inside (a prefill): slow, not failed
                "slow_steps": self.watchdog.slow_steps if self.watchdog is not None else 0}
