"""Admitting queued requests across model switches: the batch of the old model drains first.

Split from `BatchScheduler` (a mixin of it): which waiting requests join now, when the
loaded model changes, and the switch delay during which the loaded model's own waiters
still join its batch (`BaseScheduler.switch_can_wait`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from engine_daemon.errors import RequestError, engine_failure
from engine_daemon.models.store import ModelRef
from engine_daemon.request.state import EngineRequest
from engine_daemon.scheduling.base import Event, error_event

log = logging.getLogger(__name__)


class ModelSwitchAdmission:
    """`_start_waiting` and its helpers, for a scheduler with `waiting`, `pending`, `by_uid` and `models`."""

    waiting: deque[tuple[EngineRequest, ModelRef]]
    pending: deque[EngineRequest]
    by_uid: dict[int, EngineRequest]
    models: Any
    scoring: Any  # `PromptScoring`: a prompt being scored holds the loaded model and KV of it

    def _running_on_current(self) -> bool:
        """Requests that hold the loaded model: in the batch, waiting for a slot, or scoring their prompts."""
        return bool(self.by_uid or self.pending or self.scoring)

    def _start_waiting(self) -> list[Event]:
        """Admits queued requests, switching models once the batch of the old one drained."""
        events: list[Event] = []
        while self.waiting:
            request, ref = self.waiting[0]
            current = self.models.current
            if current is None or current.ref != ref:
                if current is not None and self._running_on_current() and self.switch_can_wait():
                    # Within the switch delay the loaded model's own waiters still join its batch.
                    events += self._admit_waiting_for(current.ref)
                    break
                if self._running_on_current():
                    break  # the running batch finishes on the current model first
                self.on_unload()
                try:
                    self.models.ensure(ref)
                except RequestError as exc:  # a model that cannot serve generation (an audio model): a 400
                    self.waiting.popleft()
                    events.append(self.refuse(request, exc))
                    continue
                except Exception as exc:
                    log.exception("could not load %s", ref.id)
                    self.waiting.popleft()
                    events.append(error_event(request, engine_failure(exc)))
                    continue
            self.waiting.popleft()
            events += self._accept_and_admit(request)
        return events

    def _accept_and_admit(self, request: EngineRequest) -> list[Event]:
        try:
            self.accept(request)
            return self._admit(request)
        except RequestError as exc:
            return [self.refuse(request, exc)]

    def _admit_waiting_for(self, ref: ModelRef) -> list[Event]:
        """Admits the waiting requests for `ref` (the loaded model) from anywhere in the queue, in order."""
        mine = [item for item in self.waiting if item[1] == ref]
        self.waiting = deque(item for item in self.waiting if item[1] != ref)
        return [event for request, _ in mine for event in self._accept_and_admit(request)]

