"""What each engine serves, as its catalogue last said: known to every worker, without a request.

Why: while an engine is down, a request naming its model is that engine's outage (a 503 the client
retries), yet the other engines refuse the name (404 `model_not_found`, 400 `invalid_model_name`).
Which spellings of a model a worker learned (`ModelSpellings`) depends on the requests that worker
happened to serve, so behind gunicorn the same request got a 503 from one worker and a 404 from
another. Each worker therefore asks every engine for its catalogue (`list_models`: the operator's
names, the models under --model-dir and in the HF cache, the loaded one) as soon as the engine
answers, again whenever it restarts (a new epoch) or loads another model, and every
REFRESH_SECONDS; the last catalogue is kept while the engine is down.

A worker that gunicorn starts after an engine died cannot list it: each catalogue is therefore also
written to a directory the gunicorn master makes for its workers (`gunicorn_settings.SHARED_DIR_ENV`),
and a worker takes from there the catalogue of an engine it never listed itself, so every worker of a
front-end answers alike. Without that directory (the app run by hand) or before any worker listed the
engine, `known` is False and the pool treats the engine as possibly serving any model (`EnginePool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any

from http_frontend.engine.client import EngineLink
from protocol import CallMethod

log = logging.getLogger(__name__)

# Directories under --model-dir come and go, but a catalogue matters only once its engine is down, and listing
# walks the model roots and the HF cache on the engine's io thread (every worker asks every engine): rarely.
REFRESH_SECONDS = 600.0
RETRY_SECONDS = 5.0  # an engine that did not answer is asked again after this
POLL_SECONDS = 0.5  # how often the engines' epochs and loaded models are compared with the catalogues'
LIST_TIMEOUT = 30.0  # listing walks the model roots and the HF cache on the engine's io thread
PATH_PREFIXES = ("/", "./", "../", "~")


def path_spellings(name: str) -> tuple[str, ...]:
    """A filesystem path's normalized spelling, then each shorter tail of it (`/m/org/x`: `org/x`, `x`).

    A model under --model-dir is listed by its name there, the loaded one by its path as typed: a
    path naming either ends in that name. Only names that read as paths are taken apart: `org/name`
    is a Hub repository, not a directory.
    """
    if not name.startswith(PATH_PREFIXES):
        return ()
    normal = posixpath.normpath(name)
    parts = [part for part in normal.split("/") if part and part not in (".", "..", "~")]
    return (normal, *("/".join(parts[start:]) for start in range(len(parts))))


class Catalogues:
    """The names each engine of one worker's pool lists, refreshed in the background (`run`)."""

    def __init__(self, links: Mapping[str, EngineLink], routable: Callable[[str], bool],
                 clock: Callable[[], float] = time.monotonic, shared_dir: str | None = None):
        self.links = links
        self.routable = routable
        self.clock = clock
        self.shared_dir = shared_dir
        self._adopted: dict[str, int] = {}  # engine -> mtime_ns of the shared file its names were taken from
        self._names: dict[str, frozenset[str]] = {}
        self._fetched_for: dict[str, tuple[Any, Any]] = {}  # engine -> (epoch, model) its catalogue was listed at
        self._due: dict[str, float] = {}
        self._fetching: dict[str, asyncio.Task] = {}
        self.first_round = asyncio.Event()  # set once every engine that answered has been listed (or failed)

    def names(self, engine_id: str) -> frozenset[str]:
        return self._names.get(engine_id, frozenset())

    def known(self, engine_id: str) -> bool:
        """Whether this worker has engine `engine_id`'s catalogue, its own or another worker's (`adopt_shared`).

        Not when no worker of this front-end ever listed it: every worker started after it died."""
        return engine_id in self._names

    def lists(self, engine_id: str, name: str) -> bool:
        """Whether engine `engine_id`'s last catalogue lists `name`, or a path whose tail is a name it lists."""
        names = self._names.get(engine_id)
        if not names:
            return False
        if name in names:
            return True
        spellings = path_spellings(name)
        return any(spelling in names for spelling in spellings) or any(
            spellings[0] == posixpath.normpath(listed) for listed in names if listed.startswith(PATH_PREFIXES))

    def _version(self, engine_id: str) -> tuple[Any, Any]:
        link = self.links[engine_id]
        return getattr(link, "epoch", None), getattr(link, "model", None)

    def _is_due(self, engine_id: str, now: float) -> bool:
        return engine_id not in self._fetching and self.routable(engine_id) and (
            self._fetched_for.get(engine_id) != self._version(engine_id) or now >= self._due.get(engine_id, 0.0))

    def _shared_path(self, engine_id: str) -> str | None:
        return os.path.join(self.shared_dir, f"catalogue-{engine_id}.json") if self.shared_dir else None

    def _share(self, engine_id: str, names: frozenset[str]) -> None:
        """Writes the catalogue for the other workers (whole, then renamed: a reader never sees half of it)."""
        path = self._shared_path(engine_id)
        if path is None:
            return
        try:
            temporary = f"{path}.{os.getpid()}.tmp"
            with open(temporary, "w", encoding="utf-8") as file:
                json.dump({"engine": engine_id, "names": sorted(names)}, file)
            os.replace(temporary, path)
        except OSError as exc:
            log.debug("could not share engine %s's catalogue: %s", engine_id, exc)

    def adopt_shared(self) -> None:
        """Takes, from the other workers, the catalogue of each engine this worker never listed itself."""
        for engine_id in self.links:
            path = self._shared_path(engine_id)
            if path is None or engine_id in self._fetched_for:
                continue
            try:
                mtime = os.stat(path).st_mtime_ns
                if self._adopted.get(engine_id) == mtime:
                    continue
                with open(path, encoding="utf-8") as file:
                    shared = json.load(file)
                names = frozenset(name for name in shared["names"] if isinstance(name, str))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # none yet, or unreadable: this worker knows nothing of that engine
            self._names[engine_id] = names
            self._adopted[engine_id] = mtime

    def refresh(self) -> list[asyncio.Task]:
        """Starts listing every engine that is due, one task each (a slow engine holds up no other)."""
        self.adopt_shared()
        now = self.clock()
        for engine_id in [engine_id for engine_id in self.links if self._is_due(engine_id, now)]:
            self._fetching[engine_id] = asyncio.create_task(self._fetch(engine_id))
        return list(self._fetching.values())

    async def _fetch(self, engine_id: str) -> None:
        version = self._version(engine_id)
        try:
            answer = await self.links[engine_id].call(CallMethod.LIST_MODELS, timeout=LIST_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, or a stand-in without the CALL
            log.debug("engine %s did not list its models: %s", engine_id, exc)
            answer = None
        finally:
            self._fetching.pop(engine_id, None)
        if not isinstance(answer, list):
            self._due[engine_id] = self.clock() + RETRY_SECONDS  # the last catalogue stays
            return
        names = frozenset(entry["id"] for entry in answer
                          if isinstance(entry, dict) and isinstance(entry.get("id"), str))
        self._names[engine_id] = names
        self._fetched_for[engine_id] = version
        self._share(engine_id, names)
        self._due[engine_id] = self.clock() + REFRESH_SECONDS

    async def run(self) -> None:
        """Until cancelled: lists the engines when they answer, restart, load another model, and every while."""
        try:
            while True:
                try:
                    started = self.refresh()
                    if started and not self.first_round.is_set():
                        await asyncio.wait(started)
                except Exception:
                    log.exception("listing the engines' models failed")
                self.first_round.set()
                await asyncio.sleep(POLL_SECONDS)
        finally:
            fetching = list(self._fetching.values())
            for task in fetching:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*fetching, return_exceptions=True)
