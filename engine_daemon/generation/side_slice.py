"""A slice of a prompt scored for its own logprobs, riding in the running streams' decode pass.

Why: a prompt scored beside streams (`PromptScoring`) went through the model in passes of its own
between the batch's steps, and each such pass read every weight again for a few dozen positions:
on the ~85M CPU bench model a prompt scored beside four streams took ~3.5x its time alone. A decode
step reads every weight anyway, so the slice rides in it as a paced prompt's chunk does
(`fused_forward_carried`, Sarathi-Serve's stall-free batching): its rows go through the same pass as
the streams' tokens, and the pass hands back the logits of every slice row, not only its last.

Only when the step would decode and nothing else: no prompt being prefilled or waiting to be (its
chunk rides there), a fusable model (`fusable`). The slice's logits are computed in the step's graph,
which mlx-lm evaluates asynchronously: they are read once the next step has returned its tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine_daemon.generation.fused_stand_ins import FusedDecode
from engine_daemon.generation.stall_free import StallFreeBatchGenerator


@dataclass
class SideSlice:
    """Positions of a scored prompt to feed in the next decode step; `logits` (C, vocab) once it rode there."""

    adapter: str | None  # the batch it can ride in: its adapter's (`GroupedGenerator`)
    inputs: list[int]
    cache: list[Any]  # the prompt's own KV: the slice's lands there
    logits: mx.array | None = None
    step: int = -1  # the scheduler's step it rode in


def rides(generator: StallFreeBatchGenerator) -> bool:
    """Whether the generator's next step is a fusable decode step and nothing else (see the module's docstring)."""
    return (generator.fuse and len(generator._generation_batch) > 0 and not generator._unprocessed_sequences
            and len(generator._prompt_batch) == 0 and not generator._currently_processing
            and generator.carry.carry is None)


@contextmanager
def riding(generator: StallFreeBatchGenerator, side: SideSlice) -> Iterator[None]:
    """The generator's next step with `side` in its decode pass; `side.logits` set once it ran there."""
    decode = generator._generation_batch
    fused = FusedDecode(generator.model, side.inputs, side.cache, all_logits=True)
    decode.model = fused
    try:
        yield
    finally:
        decode.model = generator.model
    if fused.used:
        side.logits = fused.prompt_logits.reshape(len(side.inputs), -1)
