"""Whether an engine's loaded model is the one a request names, however the client spelled it.

Why: each engine reports its loaded model under the name it was loaded by (its `--model` path as
typed, an alias, a name under `--model-dir`). A request may name the same model otherwise: a
trailing slash, `./`, a symlink, the directory's name under `--model-dir`, the repo of a served
name, a name `--model-fallback` or a glob alias sends there. Compared literally, such a request
was routed as if no engine had its model: to an idle engine or any, which then switched models for
it (or refused it). The front-end cannot read the engines' disks, so it asks each engine once
(`resolve_model`: the name resolved exactly as generation resolves it, nothing loaded) and keeps
the answer per (engine, loaded model, name). A name is an engine's model only when that engine
says it runs it on the model it has loaded, so two different models (an alias with its own
settings, another directory) are never routed as one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from http_frontend.engine.client import EngineError, EngineLink
from protocol import CallMethod

LEARNED_SECONDS = 60.0  # an answer holds this long (directories under --model-dir come and go)
RETRY_SECONDS = 5.0  # an engine that did not answer is asked again after this
LOOKUP_TIMEOUT = 2.0  # the most a request waits for the engines' answers (on their admission pools)
SETTLE_SECONDS = 0.25  # once an engine runs the name, the longest the others' answers are awaited
MAX_ENTRIES = 4096  # names come from clients: bounded
MAX_NAME_CHARS = 255  # engines refuse longer names; never asked


class ModelSpellings:
    """What each engine said of the names requests used, keyed by the model it had loaded."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._known: dict[tuple[str, str, str], tuple[bool, float]] = {}  # key -> (its model, valid until)

    def serves(self, engine_id: str, loaded: str | None, name: str | None) -> bool:
        """Whether requests naming `name` run on `loaded`, the model engine `engine_id` has (as learned)."""
        if not loaded or not isinstance(name, str):
            return False
        if loaded == name:
            return True
        known = self._known.get((engine_id, loaded, name))
        return known is not None and known[0] and known[1] > self.clock()  # an answer past its time is not one

    def answered(self, engine_id: str, loaded: str | None, name: str | None) -> bool:
        """Whether engine `engine_id`, asked while it had `loaded`, said `name` runs on it, however long ago.

        For an engine that is down: it cannot be asked again, and its last answer is what is known of it.
        """
        if not loaded or not isinstance(name, str):
            return False
        known = self._known.get((engine_id, loaded, name))
        return loaded == name or (known is not None and known[0])

    def _stale(self, key: tuple[str, str, str], now: float) -> bool:
        known = self._known.get(key)
        return known is None or known[1] <= now

    async def learn(self, name: Any, links: Mapping[str, EngineLink], routable: Callable[[str], bool]) -> None:
        """Asks the routable engines with a model loaded under another name what `name` runs on (those not
        asked lately), all at once, waiting at most LOOKUP_TIMEOUT.

        Once an engine is known to run `name` on its loaded model (it has it loaded under that name, or it
        said so), the others get SETTLE_SECONDS more: an engine that just froze or died (taken as down only
        after 2 s without an answer) must not hold up the requests for a live engine's model that long. A
        late answer is still kept when it comes.
        """
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            return
        now = self.clock()
        asks = [(engine_id, loaded) for engine_id, link in links.items()
                if routable(engine_id) and isinstance(loaded := getattr(link, "model", None), str) and loaded
                and loaded != name and self._stale((engine_id, loaded, name), now)]
        if not asks:
            return
        if len(self._known) + len(asks) > MAX_ENTRIES:
            self._known = {key: known for key, known in self._known.items() if known[1] > now}
            if len(self._known) + len(asks) > MAX_ENTRIES:
                self._known.clear()
        loop = asyncio.get_running_loop()
        tasks = {asyncio.ensure_future(links[engine_id].call(CallMethod.RESOLVE_MODEL, {"model": name},
                                                             timeout=LOOKUP_TIMEOUT)): (engine_id, loaded)
                 for engine_id, loaded in asks}
        for engine_id, loaded in asks:  # asked: not again by the requests that come meanwhile
            self._known[(engine_id, loaded, name)] = (False, now + RETRY_SECONDS)
        deadline = loop.time() + LOOKUP_TIMEOUT
        if any(routable(engine_id) and getattr(link, "model", None) == name for engine_id, link in links.items()):
            deadline = loop.time() + SETTLE_SECONDS
        pending = set(tasks)
        try:
            while pending and (left := deadline - loop.time()) > 0:
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if self._record(*tasks[task], name, task):
                        deadline = min(deadline, loop.time() + SETTLE_SECONDS)
        finally:
            for task in pending:  # the late answers are kept as they come (each CALL ends by LOOKUP_TIMEOUT)
                engine_id, loaded = tasks[task]
                task.add_done_callback(lambda done, e=engine_id, m=loaded: self._record(e, m, name, done))

    def _record(self, engine_id: str, loaded: str, name: str, task: asyncio.Future) -> bool:
        """Keeps what engine `engine_id` answered for `name`; True when it runs `name` on `loaded`."""
        answer = None if task.cancelled() else (task.exception() or task.result())
        now = self.clock()
        if isinstance(answer, dict):  # the model it runs on; the one loaded when the engine answered aside
            self._known[(engine_id, loaded, name)] = (answer.get("id") == loaded, now + LEARNED_SECONDS)
            return answer.get("id") == loaded
        if isinstance(answer, EngineError):  # unknown there, refused, or an engine without the CALL
            self._known[(engine_id, loaded, name)] = (False, now + LEARNED_SECONDS)
        else:  # unreachable, too slow: the literal comparison for now
            self._known[(engine_id, loaded, name)] = (False, now + RETRY_SECONDS)
        return False
