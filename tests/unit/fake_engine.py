"""A stand-in for the front-end's engine client, for driving routes in-process.

`FakeEngine` has the members of `EngineLink` (what `create_app(engine=...)` takes).
It answers ADDs with scripted ACCEPTED / DELTAS / ERROR frames fed into the real
`RequestStream` collector, and CALLs with canned results; every frame it receives
or sends goes through the protocol's own `encode`/`decode`, so a route that builds
an ADD or CALL the engine would refuse fails here too. Nothing starts a process,
opens a socket or imports mlx.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from falcon import testing

from http_frontend.app import create_app
from http_frontend.engine.client import EngineError, EngineUnavailable, RequestStream, Update
from http_frontend.settings import FrontendSettings
from protocol import CallMethod, MsgType, decode, encode, new_request_id

MODEL = "fake-model"
PROMPT_TOKENS = 5


def wire(msg_type: MsgType, body: dict[str, Any]) -> dict[str, Any]:
    """`body` after a trip through the wire format (raises ProtocolError when the engine would refuse it)."""
    return decode(encode(msg_type, body))[1]


def usage(completion_tokens: int, prompt_tokens: int = PROMPT_TOKENS, cached_tokens: int = 0) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "cached_tokens": cached_tokens}


def say(*pieces: str, finish_reason: str = "stop", **final: Any) -> list[dict[str, Any]]:
    """DELTAS items: one per text piece, then the last one with the finish reason and usage."""
    items: list[dict[str, Any]] = [{"text": piece, "token_ids": [index]} for index, piece in enumerate(pieces)]
    return items + [{"finish_reason": finish_reason, "usage": usage(len(pieces)), **final}]


class ScriptedStream(RequestStream):
    """The real collector, fed one scripted item each time a route asks for more.

    One item per `next_update`, so each becomes its own update (and SSE event) as it
    would when the engine is slower than the route. An exhausted script leaves the
    request running: the route then sees keep-alive ticks until it gives up.
    """

    def __init__(self, rid: str, items: list[dict[str, Any]]):
        super().__init__(rid)
        self._script = list(items)

    async def next_update(self, timeout: float) -> Update | None:
        if self._script:
            item = self._script.pop(0)
            if "error" in item:
                self.on_error(wire(MsgType.ERROR, {"rid": self.rid, **item["error"]}))
            else:
                self.on_deltas(wire(MsgType.DELTAS, {"items": [{"rid": self.rid, **item}]})["items"][0])
        return await super().next_update(timeout)


def error_body(status: int, code: str, message: str = "refused by the fake engine", param: str | None = None,
               error_type: str = "invalid_request_error") -> dict[str, Any]:
    return {"status": status, "code": code, "message": message, "param": param, "type": error_type}


class FakeEngine:
    """Scripted engine client: `script(request)` gives the DELTAS items of each ADD."""

    def __init__(self, *, up: bool = True, script: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None):
        self.frontend_id = "fake-frontend"
        self.streams: dict[str, RequestStream] = {}
        self.up = up
        self.script = script or (lambda request: say("Hello", " there"))
        self.refusal: dict[str, Any] | None = None  # an ERROR body answering every ADD instead of ACCEPTED
        self.accepted_extra: dict[str, Any] = {}
        self.added: list[dict[str, Any]] = []  # ADD bodies as the engine would decode them
        self.aborted: list[tuple[str, str]] = []  # (rid, reason) of requests released before they finished
        self.released: list[tuple[str, str]] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.started = self.closed = 0
        self.replies: dict[CallMethod, Any] = {
            CallMethod.STATUS: {"state": "ready", "epoch": 1, "uptime": 1.5, "pid": 42, "queued": 0, "running": 0,
                                "model_loads": 1, "busy_seconds": 0.5, "model": MODEL, "model_kind": "text",
                                "adapter": None},
            CallMethod.STATS: {"state": "ready", "epoch": 1, "model": MODEL, "scheduler": "batch", "queued": 0,
                               "running": 0, "tokens_generated": 12, "prompt_cache_hits": 1,
                               "prompt_cache_misses": 3},
            CallMethod.LIST_MODELS: [{"id": MODEL, "created": 1700000000, "kind": "text", "loaded": True,
                                      "context_window": 4096},
                                     {"id": "org/other-model", "created": 1700000001, "kind": "vision"}],
            CallMethod.TOKENIZE: lambda args: {"tokens": [1, 2, 3], "count": 3, "max_model_len": 4096},
            CallMethod.DETOKENIZE: lambda args: {"prompt": "".join(chr(96 + t) for t in args["tokens"])},
            CallMethod.UNLOAD: {"status": "success"},
            CallMethod.RESOLVE_MODEL: EngineError(error_body(404, "model_not_found", "unknown to the fake engine",
                                                             param="model")),
            CallMethod.ADAPTERS_LIST: {"data": []},
            CallMethod.ADAPTERS_ADD: lambda args: {"name": args["name"], "registered": True},
            CallMethod.ADAPTERS_REMOVE: {"deleted": True},
            CallMethod.RESPONSES_GET: None,
            CallMethod.RESPONSES_PUT: {"stored": True},
            CallMethod.RESPONSES_DELETE: {"deleted": False},
        }

    # -- EngineLink ---------------------------------------------------------------------
    async def start(self) -> None:
        self.started += 1

    async def close(self) -> None:
        self.closed += 1

    async def submit(self, request: dict[str, Any]) -> RequestStream:
        if not self.up:
            raise EngineUnavailable("The engine is not reachable")
        rid = new_request_id(self.frontend_id)
        self.added.append(wire(MsgType.ADD, {**request, "rid": rid, "epoch": 1}))
        stream = ScriptedStream(rid, self.script(request))
        self.streams[rid] = stream
        if self.refusal is not None:
            stream.on_error(wire(MsgType.ERROR, {"rid": rid, **self.refusal}))
        else:
            stream.on_accepted(wire(MsgType.ACCEPTED, {"rid": rid, "prompt_tokens": PROMPT_TOKENS, "model": MODEL,
                                                       **self.accepted_extra}))
        return stream

    def release(self, stream: RequestStream, reason: str) -> None:
        self.streams.pop(stream.rid, None)
        self.released.append((stream.rid, reason))
        if not stream.finished:
            stream.finished = True
            self.aborted.append((stream.rid, reason))

    async def call(self, method: CallMethod | str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
        if not self.up:
            raise EngineUnavailable("The engine is not reachable")
        name = CallMethod(method)  # a name outside the enum is a bug in the route
        body = wire(MsgType.CALL, {"cid": "cid-1", "method": name.value, "args": args or {}})
        self.calls.append((body["method"], body["args"]))
        reply = self.replies[name]
        if isinstance(reply, EngineError):
            raise reply
        result = reply(body["args"]) if callable(reply) else copy.deepcopy(reply)
        return wire(MsgType.RESULT, {"cid": "cid-1", "result": result}).get("result")

    # -- scripting helpers ----------------------------------------------------------------
    def fail_call(self, method: CallMethod, status: int, code: str, message: str = "refused") -> None:
        self.replies[method] = EngineError(error_body(status, code, message))

    def methods_called(self) -> list[str]:
        return [method for method, _ in self.calls]


def stays_connected(app: Callable[..., Any]) -> Callable[..., Any]:
    """`app` seen by a client that waits for its answer.

    falcon.testing's simulated client hangs up as soon as its body is sent (its
    `receive()` then says `http.disconnect`), which `DisconnectWatch` rightly reads
    as a client gone. A real client stays: after the body, `receive()` waits.
    """
    async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        body_done = False

        async def waiting_receive() -> dict[str, Any]:
            nonlocal body_done
            if body_done:
                await asyncio.Event().wait()  # until the request ends (its watcher is cancelled)
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_done = True
            return message

        await app(scope, waiting_receive, send)

    return asgi


def client_for(engine: FakeEngine, settings: FrontendSettings | None = None, *,
               hang_up: bool = False) -> testing.TestClient:
    """A falcon TestClient on the whole app (middleware, error handlers, wrappers) around `engine`."""
    app = create_app(settings=settings or FrontendSettings(), engine=engine)
    return testing.TestClient(app if hang_up else stays_connected(app))


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event; comments (keep-alives) left out."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:"):].strip())
        if data:
            events.append((name, "\n".join(data)))
    return events
