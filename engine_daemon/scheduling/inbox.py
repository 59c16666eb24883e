"""The mlx thread's share of the command queue per step: bounded, with ABORTs merged; what it answers as it stops.

An ABORT storm (570k frames in 20 s from a hostile peer) was handled one command at a time before
every step, each a scan of the queue and the batch: a victim's 300-token stream took 3.6 times as
long. Now at most `MAX_COMMANDS_PER_STEP` commands are taken between two steps (the rest wait for the
next one), and consecutive ABORTs become one `PendingAborts`: one scheduler abort for all their ids.
"""

from __future__ import annotations

import logging
import queue
from typing import Any

from engine_daemon.errors import SHUTTING_DOWN, clipped
from engine_daemon.scheduling.base import Event, error_event
from engine_daemon.scheduling.commands import (
    AbortCommand,
    AddCommand,
    AuxiliaryCommand,
    AuxiliaryReadyCommand,
    CallCommand,
    ReplyCommand,
)
from protocol import MsgType

log = logging.getLogger(__name__)

MAX_COMMANDS_PER_STEP = 1024
LOGGED_RIDS = 8  # request ids an abort's log line names


class PendingAborts:
    """ABORTs taken from the queue and not yet applied, merged."""

    def __init__(self, *commands: AbortCommand) -> None:
        self.commands: list[AbortCommand] = list(commands)  # merged when applied: taking one costs an append

    def add(self, command: AbortCommand) -> None:
        self.commands.append(command)

    def __bool__(self) -> bool:
        return bool(self.commands)

    @staticmethod
    def named(rids: set[str]) -> str:
        """The ids for a log line: clipped, and at most `LOGGED_RIDS` of them."""
        listed = sorted(rids)
        more = f" and {len(listed) - LOGGED_RIDS} more" if len(listed) > LOGGED_RIDS else ""
        return ",".join(clipped(rid) for rid in listed[:LOGGED_RIDS]) + more

    def reasons(self, peer: bytes | None = None) -> str:
        return ",".join(sorted({clipped(c.reason) for c in self.commands if peer is None or c.peer == peer}))

    def apply(self, scheduler: Any, aux_jobs: Any) -> PendingAborts:
        """Aborts the requests and long auxiliary CALLs (audio) named; returns an empty `PendingAborts`."""
        if not self.commands:
            return self
        rids = {rid for command in self.commands if command.peer is None for rid in command.rids}
        by_peer: dict[bytes, set[str]] = {}
        for command in self.commands:
            if command.peer is not None:
                by_peer.setdefault(command.peer, set()).update(command.rids)
        try:
            for peer, named in by_peer.items():  # another front-end's requests are not its to end
                mine, foreign = scheduler.owned_by(peer, named)
                rids |= mine
                if foreign:
                    log.info("ignored an ABORT (%s) of %d request(s) another front-end sent: rid=%s",
                             self.reasons(peer), len(foreign), self.named(foreign))
            found = scheduler.abort(rids) if rids else 0
            if aux_jobs.has_work():  # an ABORT also names its sender's auxiliary CALLs (cids)
                for peer, named in by_peer.items():
                    found += aux_jobs.cancel(peer, named)
        except Exception:  # a bug here must not stop the mlx thread, nor fail what follows in the queue
            log.exception("aborting %d request(s) failed", len(rids))
            return PendingAborts()
        if found:
            log.info("aborted %d request(s) (%s): rid=%s", found, self.reasons(), self.named(rids))
        return PendingAborts()


def shutdown_events(scheduler: Any, aux_jobs: Any, commands: queue.Queue) -> list[Event]:
    """On a clean stop (SIGTERM): an `engine_shutting_down` ERROR for every open request and CALL, and for what
    still waits in the queue, so each client hears why at once instead of a dead engine 2 s later."""
    try:
        events = [error_event(request, SHUTTING_DOWN) for request in scheduler.all_requests()]
        events += aux_jobs.fail(None, SHUTTING_DOWN)
        if events:
            log.info("shutting down: %d open request(s) and CALL(s) told so", len(events))
    except Exception:  # the stop goes on: these clients then hear of a dead engine instead
        log.exception("telling the open requests of the shutdown failed")
        events = []
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            return events
        if isinstance(command, AddCommand):
            events.append((command.peer, MsgType.ERROR, SHUTTING_DOWN.to_body(command.body["rid"])))
        elif isinstance(command, ReplyCommand) and command.error is None:
            events.append((command.peer, MsgType.RESULT, {"cid": command.cid, "result": command.result}))
        elif isinstance(command, (CallCommand, AuxiliaryCommand, AuxiliaryReadyCommand, ReplyCommand)):
            events.append((command.peer, MsgType.ERROR, {**SHUTTING_DOWN.to_body(None), "cid": command.cid}))
