"""What a fused step puts in place of mlx-lm's two model calls: the decode model and the prompt batch's `prompt`.

`StallFreeBatchGenerator` runs mlx-lm's own `_next` for a fused step, with the decode
batch's model replaced by `FusedDecode` (the one pass over the decode rows and the chunk,
`fused_forward_carried`) and the prompt batch's `prompt` by `ChunkRecorded` (the chunk is
already in that pass: only its bookkeeping remains).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch

from engine_daemon.generation.fused_step import fused_forward_carried
from engine_daemon.generation.layer_carry import LayerCarry, Leaving


class FusedDecode:
    """Stands in for the model in the decode batch's call: runs the fused pass.

    `carry`: an earlier chunk's rows that rejoin the pass where they left it; `leaving`: asked
    before each layer which prompt rows leave the pass (`LayerDeadline`). After the call,
    `carried` holds the rows that left the pass (None: the chunk went through every layer).
    """

    def __init__(self, model: Any, chunk: list[int], chunk_cache: list[Any], ends_prompt: bool = False,
                 carry: LayerCarry | None = None, leaving: Callable[[int], Leaving] | None = None,
                 all_logits: bool = False):
        self.model, self.chunk, self.chunk_cache = model, chunk, chunk_cache
        self.ends_prompt, self.all_logits = ends_prompt, all_logits  # all_logits: every chunk row's (`SideSlice`)
        self.carry, self.leaving = carry, leaving
        self.carried: LayerCarry | None = None
        self.prompt_logits: mx.array | None = None  # the chunk's last token's when it ends its prompt, or all of them
        self.used = False

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        self.used = True
        logits, self.carried = fused_forward_carried(
            self.model, inputs, cache, mx.array([self.chunk]), self.chunk_cache, chunk_last_logits=self.ends_prompt,
            carry=self.carry, leaving=self.leaving, chunk_tokens=self.chunk, chunk_all_logits=self.all_logits)
        if not (self.ends_prompt or self.all_logits):
            return logits
        rows = inputs.shape[0]
        self.prompt_logits = logits[rows:]
        return logits[:rows]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class ChunkRecorded:
    """Stands in for the prompt batch's `prompt` in a fused step: the chunk is already in the decode pass.

    mlx-lm's `prompt` would run the model on the chunk, then wait for the chunk's KV
    (`mx.eval`) and empty MLX's buffer cache. The fused pass computes that KV inside the
    decode step's graph, which mlx-lm evaluates asynchronously; waiting for it here would
    serialise every fused step with the building of the next one (the pipelining decode
    steps have), and emptying the buffer cache would make the next step allocate afresh.
    So only the bookkeeping remains: the prompt's token list gains the chunk.
    """

    def __init__(self, batch: PromptProcessingBatch, chunk: list[int]):
        self.batch, self.chunk = batch, chunk
        self.used = False

    def __call__(self, tokens: list[list[int]]) -> None:
        if len(tokens) != 1 or list(tokens[0]) != self.chunk:  # never silently skip a chunk nobody computed
            raise RuntimeError(f"fused prefill expected its chunk of {len(self.chunk)} tokens, got {tokens!r:.80}")
        self.batch.tokens[0] += tokens[0]
        self.used = True
