"""Every CALL method, the thread that answers it and its handler: the one place that says so.

io-thread handlers read published state and answer at once (so /health works during a
long prefill); mlx-thread handlers are queued to the mlx thread with the call
(`CallCommand`) because they touch MLX objects. A handler refuses a call by raising
`RequestError`; the engine answers it as an ERROR frame with the call's id.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_daemon.calls import audio, auxiliary, catalogue, drain, io_thread, mlx_thread, models, tokenize
from protocol import CallMethod


class Thread(enum.Enum):
    IO = "io"
    MLX = "mlx"
    POOL = "pool"  # the admission pool (`Preprocessor`): tokenizer work on client input, off the mlx thread
    # auxiliary models (`AuxiliarySlots`): the handler checks the args on the io thread and returns an
    # `AuxiliaryRequest`; the mlx thread loads the model, the pool prepares the job, the mlx thread runs it
    AUX = "aux"
    # a thread of its own (`transport.disk_calls`): handlers that read the disk, as io-thread ones do otherwise;
    # on the io thread a slow scan held every stream's frames, on the mlx thread it would wait for each step
    DISK = "disk"


@dataclass(frozen=True)
class CallSpec:
    thread: Thread
    # io and disk: (IoContext, args) -> result; aux: (IoContext, args) -> AuxiliaryRequest;
    # mlx: (MlxContext, args) -> (events, result); pool: (the loaded model or None, args) -> result
    handler: Callable[[Any, dict[str, Any]], Any]


CALLS: dict[CallMethod, CallSpec] = {
    CallMethod.STATUS: CallSpec(Thread.IO, io_thread.status),
    CallMethod.LIST_MODELS: CallSpec(Thread.DISK, catalogue.list_models),
    CallMethod.STATS: CallSpec(Thread.IO, io_thread.stats),
    CallMethod.STEP_GAPS: CallSpec(Thread.IO, io_thread.step_gaps),
    CallMethod.ADAPTERS_LIST: CallSpec(Thread.IO, io_thread.adapters_list),
    CallMethod.RESPONSES_PUT: CallSpec(Thread.IO, io_thread.responses_put),
    CallMethod.RESPONSES_GET: CallSpec(Thread.IO, io_thread.responses_get),
    CallMethod.RESPONSES_DELETE: CallSpec(Thread.IO, io_thread.responses_delete),
    CallMethod.DRAIN: CallSpec(Thread.IO, drain.drain),
    CallMethod.UNLOAD: CallSpec(Thread.MLX, mlx_thread.unload),
    CallMethod.ADAPTERS_ADD: CallSpec(Thread.MLX, mlx_thread.adapters_add),
    CallMethod.ADAPTERS_REMOVE: CallSpec(Thread.MLX, mlx_thread.adapters_remove),
    CallMethod.TOKENIZE: CallSpec(Thread.POOL, tokenize.tokenize),
    CallMethod.DETOKENIZE: CallSpec(Thread.POOL, tokenize.detokenize),
    CallMethod.RESOLVE_MODEL: CallSpec(Thread.POOL, models.resolve_model),
    CallMethod.EMBEDDINGS: CallSpec(Thread.AUX, auxiliary.embeddings),
    CallMethod.TRANSCRIBE: CallSpec(Thread.AUX, audio.transcribe),
    CallMethod.SPEECH: CallSpec(Thread.AUX, audio.speech),
    CallMethod.DEBUG_SLEEP: CallSpec(Thread.MLX, mlx_thread.debug_sleep),
    CallMethod.DEBUG_CRASH: CallSpec(Thread.MLX, mlx_thread.debug_crash),
}


def lookup(method: str) -> CallSpec | None:
    """The spec of a CALL method name from the wire; None for a name outside `CallMethod`."""
    try:
        return CALLS[CallMethod(method)]
    except ValueError:
        return None
