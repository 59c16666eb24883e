"""What the io thread asks of the mlx thread: one small value per command, through a queue.

Plain Python values only (no sockets, no MLX objects): the io thread builds them, the mlx
thread (`MlxWorker`) handles them between two scheduler steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_daemon.auxiliary.jobs import AuxiliaryJob, AuxiliaryRequest
from engine_daemon.errors import RequestError
from engine_daemon.request.state import PreparedPrompt


@dataclass(frozen=True)
class AddCommand:
    """A validated ADD from a front-end: admit the request (or refuse it) at the next step."""

    peer: bytes
    body: dict[str, Any]
    prepared: PreparedPrompt | None = None  # its prompt, tokenized off the mlx thread (`Preprocessor`)


@dataclass(frozen=True)
class AbortCommand:
    rids: list[str]
    reason: str = "client"
    peer: bytes | None = None  # who sent it: an ABORT also names that front-end's auxiliary CALLs (cids)


@dataclass(frozen=True)
class PeerGoneCommand:
    """A front-end vanished (BYE, a failed send, silence): abort all of its requests."""

    peer: bytes


@dataclass(frozen=True)
class CallCommand:
    """A CALL whose handler must run on the mlx thread (see `engine_daemon.calls.table.CALLS`)."""

    peer: bytes
    cid: str
    method: str
    handler: Callable[[Any, dict[str, Any]], Any]
    args: dict[str, Any]


@dataclass(frozen=True)
class ReplyCommand:
    """The answer of a CALL run on the admission pool, sent by the mlx thread with its other frames."""

    peer: bytes
    cid: str
    result: Any = None
    error: RequestError | None = None


@dataclass(frozen=True)
class AuxiliaryCommand:
    """An auxiliary CALL (embeddings, ...): the mlx thread loads its model and makes its job."""

    peer: bytes
    cid: str
    request: AuxiliaryRequest


@dataclass(frozen=True)
class AuxiliaryReadyCommand:
    """An auxiliary job back from its off-thread `prepare` (or the error it raised): queue it."""

    peer: bytes
    cid: str
    job: AuxiliaryJob
    error: RequestError | None = None


@dataclass(frozen=True)
class StopCommand:
    """Wakes the mlx thread so it sees that it must stop."""


Command = (AddCommand | AbortCommand | PeerGoneCommand | CallCommand | ReplyCommand | AuxiliaryCommand
           | AuxiliaryReadyCommand | StopCommand)
