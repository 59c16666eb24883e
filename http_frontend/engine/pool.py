"""The engines behind one front-end worker: one `EngineClient` each, and the router between them.

Routes hold the pool where they held one client: it has the client's members
(`EngineLink`), so `submit` picks an engine (`routing.pick`: affinity, rendezvous
order, bounded load, health) and `call` goes to one engine, a named one or the
first that can serve. A pool of one engine is today's single client: its one
engine takes everything, whatever its state, and its errors are the client's.

Draining: `drain` marks an engine not routable in this worker at once and asks the
engine to say `draining` in its PONGs, so every other worker on every host stops
routing there within a ping; its open streams run to their end.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from http_frontend.engine.catalogues import Catalogues
from http_frontend.engine.client import EngineClient, EngineError, EngineLink, EngineUnavailable, RequestStream
from http_frontend.engine.model_names import ModelSpellings
from http_frontend.engine.routing import DEFAULT_EPSILON, DEFAULT_MIN_BOUND, Candidate, pick
from http_frontend.gunicorn_settings import SHARED_DIR_ENV
from protocol import CallMethod

# What an engine answers for a model it cannot load (the same pair `relay.generation` turns into a 503)
MODEL_REFUSALS = ("invalid_model_name", "model_not_found")

log = logging.getLogger(__name__)

RESPONSE_PREFIX = "resp_"
STARTUP_WAIT = 3.0  # seconds a worker waits at start for every engine's first answer


@dataclass(frozen=True)
class RouteHint:
    """What the router needs of a request: its affinity key, the model, an engine it should prefer."""

    key: str
    model: str | None = None
    preferred: str | None = None  # the engine that holds the previous response


class StreamsView(Mapping[str, RequestStream]):
    """Every engine's open requests of this worker, read as one mapping (`len`, lookups)."""

    def __init__(self, links: Sequence[EngineLink]):
        self._links = links

    def __getitem__(self, rid: str) -> RequestStream:
        for link in self._links:
            if rid in link.streams:
                return link.streams[rid]
        raise KeyError(rid)

    def __iter__(self) -> Iterator[str]:
        for link in self._links:
            yield from link.streams

    def __len__(self) -> int:
        return sum(len(link.streams) for link in self._links)


class EnginePool:
    """One worker's engines by id, with `submit` routed and `call` addressed."""

    def __init__(self, links: Mapping[str, EngineLink], epsilon: float = DEFAULT_EPSILON,
                 min_bound: int = DEFAULT_MIN_BOUND, shared_dir: str | None = None):
        if not links:
            raise ValueError("an engine pool needs at least one engine")
        self.links = dict(links)
        self.epsilon = epsilon
        self.min_bound = min_bound
        first = next(iter(self.links.values()))
        self.frontend_id = first.frontend_id
        self.streams = StreamsView(list(self.links.values()))
        self.spellings = ModelSpellings()  # which engine's loaded model a request's `model` names (`model_names`)
        # What each engine lists, kept while it is down and shared with this master's other workers
        self.catalogues = Catalogues(self.links, self.routable, shared_dir=shared_dir)
        self._catalogue_task: asyncio.Task | None = None

    @property
    def single(self) -> bool:
        return len(self.links) == 1

    @property
    def ids(self) -> list[str]:
        return list(self.links)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Connects to every engine; with several, waits (a bounded while) for each one's first answer.

        A worker that served before every engine had answered would send the conversations of the
        silent ones elsewhere: right after each start or reload, affinity (and the caches) would be lost.
        """
        for link in self.links.values():
            await link.start()
        if not self.single:
            waits = [link.wait_ready(STARTUP_WAIT) for link in self.links.values() if hasattr(link, "wait_ready")]
            ready = await asyncio.gather(*waits)
            if not all(ready):
                log.warning("%d of %d engines did not answer within %.0f s of start: serving with the others",
                            ready.count(False), len(ready), STARTUP_WAIT)
            # Every worker knows each engine's models before its first request (`serves_while_down`).
            self._catalogue_task = asyncio.create_task(self.catalogues.run())
            try:
                await asyncio.wait_for(self.catalogues.first_round.wait(), STARTUP_WAIT)
            except asyncio.TimeoutError:
                log.warning("the engines did not list their models within %.0f s of start", STARTUP_WAIT)

    async def close(self) -> None:
        if self._catalogue_task is not None:
            self._catalogue_task.cancel()
            await asyncio.gather(self._catalogue_task, return_exceptions=True)
        await asyncio.gather(*(link.close() for link in self.links.values()), return_exceptions=True)

    # -- state ---------------------------------------------------------------------------
    def routable(self, engine_id: str) -> bool:
        link = self.links.get(engine_id)
        return link is not None and bool(getattr(link, "routable", True))

    def state_of(self, engine_id: str) -> str:
        """The engine's state as this worker sees it: its PONG's, or drained / unreachable here."""
        link = self.links[engine_id]
        if not getattr(link, "alive", True):
            return "unreachable"
        return str(getattr(link, "engine_state", "ready"))

    def candidates(self, model: str | None) -> list[Candidate]:
        result = []
        for engine_id, link in self.links.items():
            loaded = getattr(link, "model", None)
            serves = model is None or loaded is None or self.spellings.serves(engine_id, loaded, model)
            result.append(Candidate(engine_id, int(getattr(link, "load", 0)), self.routable(engine_id),
                                    serves_model=serves))
        return result

    async def learn_model(self, model: Any) -> None:
        """Asks the engines whether `model`, spelled another way than their loaded model's name, is that
        model (a path with a trailing slash, a symlink, a name under --model-dir...): `ModelSpellings`."""
        if not self.single:
            await self.spellings.learn(model, self.links, self.routable)

    def choose(self, hint: RouteHint | None, exclude: set[str] | frozenset[str] = frozenset()) -> str:
        """The engine for a new request; the pool's only engine always (a pool of one is one client)."""
        if self.single:
            return next(iter(self.links))
        if hint is None:
            hint = RouteHint("")
        candidates = [c for c in self.candidates(hint.model) if c.engine_id not in exclude]
        chosen = pick(hint.key, candidates, self.epsilon, hint.preferred, self.min_bound)
        if chosen is None:
            raise EngineUnavailable(self.none_available("No engine is available (all are down, stalled or draining)"))
        return chosen

    def none_available(self, message: str) -> str:
        """`message`, then why engines refused this front-end (another protocol version), if any did."""
        refusals = [refusal for link in self.links.values() if (refusal := getattr(link, "refusal", None))]
        return "; ".join([message, *refusals])

    def serves_while_down(self, model: str | None, down: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether an engine that cannot take requests now (down, stalled, draining, or one of `down`: passed
        over or lost by this request) serves `model`, as this worker last knew it: its loaded model's name, a
        spelling it answered to (`ModelSpellings.answered`, however old) or a name its catalogue lists
        (`Catalogues`, fetched by every worker whatever requests it served, shared between workers)."""
        return bool(self.outage_message(model, down))

    def outage_message(self, model: str | None, down: frozenset[str] | set[str] = frozenset()) -> str | None:
        """The 503's message when `model` is an engine's that cannot take requests now (`serves_while_down`),
        naming that engine; None when none of them serves it."""
        if not isinstance(model, str) or not model or self.single:
            return None
        serving, unlisted = [], []
        for engine_id, link in self.links.items():
            if engine_id not in down and self.routable(engine_id):
                continue
            if (self.spellings.answered(engine_id, getattr(link, "model", None), model)
                    or self.catalogues.lists(engine_id, model)):
                serving.append(engine_id)
            elif not self.catalogues.known(engine_id):
                # No worker of this front-end ever had its catalogue (all started after it went down): it may
                # serve any model, and the live engines' 404 would be wrong whenever it does. A 503 every
                # worker answers alike; once it answers, its catalogue tells.
                unlisted.append(engine_id)
        if serving:
            return f"The engine serving '{model}' ({', '.join(serving)}) is unavailable; retry shortly"
        if unlisted:
            return (f"The model '{model}' may be served by engine {', '.join(unlisted)}, which is not reachable "
                    "(it has not listed its models to this front-end); retry shortly")
        return None

    def primary(self) -> str:
        """The engine for CALLs that any engine answers alike (tokenize, adapters list): the first routable."""
        return next((engine_id for engine_id in self.links if self.routable(engine_id)), next(iter(self.links)))

    # -- EngineLink ----------------------------------------------------------------------
    async def submit(self, request: dict[str, Any], hint: RouteHint | None = None,
                     exclude: frozenset[str] = frozenset()) -> RequestStream:
        """Sends the ADD to the chosen engine (none of `exclude`); one that cannot take it passes it on."""
        if self.single:
            engine_id = self.choose(hint)
            stream = await self.links[engine_id].submit(request)
            stream.engine_id = engine_id
            return stream
        refused: set[str] = set(exclude)
        if hint is not None:
            await self.learn_model(hint.model)
        while True:
            engine_id = self.choose(hint, exclude=refused)
            try:
                stream = await self.links[engine_id].submit(request)
            except EngineUnavailable:
                log.warning("engine %s did not take a request: trying the next one", engine_id)
                refused.add(engine_id)
                continue
            stream.engine_id = engine_id
            stream.passed_over = frozenset(refused)
            return stream

    def release(self, stream: RequestStream, reason: str) -> None:
        link = self.links.get(getattr(stream, "engine_id", None) or "") or self._owner_of_rid(stream.rid)
        link.release(stream, reason)

    def _owner_of_rid(self, rid: str) -> EngineLink:
        return next((link for link in self.links.values() if rid in link.streams), next(iter(self.links.values())))

    async def call(self, method: CallMethod | str, args: dict[str, Any] | None = None, timeout: float = 5.0,
                   engine: str | None = None) -> Any:
        """A CALL to `engine`, else to `primary` and then each other engine while they are unreachable.

        EngineUnavailable for an engine this pool does not know, or when none answers.
        """
        if engine is not None or self.single:
            link = self.links.get(engine or self.primary())
            if link is None:
                raise EngineUnavailable(f"No engine '{engine}' behind this front-end")
            return await link.call(method, args, timeout=timeout)
        failure: EngineUnavailable | None = None
        model = (args or {}).get("model")
        await self.learn_model(model)
        for engine_id in self._call_order(model):
            try:
                return await self.links[engine_id].call(method, args, timeout=timeout)
            except EngineUnavailable as exc:  # tokenize, count_tokens: any live engine answers alike
                log.warning("engine %s did not answer %s: trying the next one", engine_id, method)
                failure = exc
            except EngineError as exc:
                # Another engine refused the model of one that is down (tokenize, count_tokens): that engine's
                # outage, a 503 as generation answers (`accepted_somewhere`), not the other engine's 404.
                message = self.outage_message(model) if exc.body.get("code") in MODEL_REFUSALS else None
                if message:
                    raise EngineUnavailable(message) from None
                raise
        raise failure or EngineUnavailable("No engine behind this front-end answered")

    def _call_order(self, model: Any) -> list[str]:
        """Engines for a CALL: those serving the `model` it names first (a tokenize or count_tokens for the
        model of engine b was answered by engine a: 404), then `primary`, then the rest."""
        serving = [engine_id for engine_id, link in self.links.items() if self.routable(engine_id)
                   and self.spellings.serves(engine_id, getattr(link, "model", None), model)]
        return list(dict.fromkeys([*serving, self.primary(), *self.links]))

    async def call_streaming(self, method: CallMethod | str, args: dict[str, Any] | None = None,
                             timeout: float = 600.0, on_partial: Any = None, engine: str | None = None) -> Any:
        """A long CALL with partial RESULTs (`EngineClient.call_streaming`) to `engine` (default: `primary`)."""
        link = self.links.get(engine or self.primary())
        if link is None:
            raise EngineUnavailable(f"No engine '{engine}' behind this front-end")
        streaming = getattr(link, "call_streaming", None)
        if streaming is None:  # a stand-in engine of the tests: no partials
            return await link.call(method, args, timeout=timeout)
        return await streaming(method, args, timeout=timeout, on_partial=on_partial)

    async def call_each(self, method: CallMethod | str, args: dict[str, Any] | None = None,
                        timeout: float = 5.0) -> dict[str, Any]:
        """The CALL on every engine at once: result or exception, by engine id (in the pool's order)."""
        results = await asyncio.gather(*(link.call(method, args, timeout=timeout) for link in self.links.values()),
                                       return_exceptions=True)
        return dict(zip(self.links, results))

    # -- draining --------------------------------------------------------------------------
    def mark_drained(self, engine_id: str, draining: bool) -> None:
        """Routing in this worker follows a drain at once, before the engine's next PONG says the same.

        The engine's own state (CALL `drain`) is the truth every worker reads from its PONGs, so a
        drain made through one worker is undone through any other.
        """
        link = self.links[engine_id]
        if getattr(link, "alive", False):
            link.engine_state = "draining" if draining else "ready"
        log.info("engine %s %s", engine_id, "draining: no new requests go to it" if draining else "routable again")

    # -- response ids ----------------------------------------------------------------------
    def response_id(self, suffix: str, engine_id: str | None) -> str:
        """`resp_<engine>_<hex>` with several engines (a follow-up finds its engine); `resp_<hex>` with one."""
        if self.single or not engine_id:
            return RESPONSE_PREFIX + suffix
        return f"{RESPONSE_PREFIX}{engine_id}_{suffix}"

    def engine_of_response(self, response_id: str) -> str | None:
        """The engine id a response id names ('' for an id that names none: made by a pool of one)."""
        rest = response_id.removeprefix(RESPONSE_PREFIX)
        engine_id, sep, _ = rest.partition("_")
        return engine_id if sep else ""


def build_pool(specs: Sequence[Any], epsilon: float, max_pending_bytes: int | None,
               min_bound: int = DEFAULT_MIN_BOUND) -> EnginePool:
    """An `EngineClient` per `EngineSpec` (pool_config), all of one worker."""
    links = {spec.engine_id: EngineClient(spec.endpoint, max_pending_bytes=max_pending_bytes,
                                          engine_id=spec.engine_id, curve_server_key=spec.curve_server_key)
             for spec in specs}
    return EnginePool(links, epsilon, min_bound, shared_dir=os.environ.get(SHARED_DIR_ENV) or None)
