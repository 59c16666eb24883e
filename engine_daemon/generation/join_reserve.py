"""The buffers of the join that ends a prompt's prefill beside running streams, made ahead of it on a CPU.

Why: `join_caches` writes the running streams' KV and the newcomer's into new buffers of the
joined batch's size. The first time a batch that large exists, those buffers are memory the
process never had, and on a CPU every page of it is faulted in and zeroed by the kernel when
first written. On the 2-core VM of `bench/`, a 1,500-token prompt joining four streams of the
~85M model faulted ~94 MB (188 MB on the 0.5B model) inside the step after the join, where the
copies contended with the decode step's matrix products for the two cores: that step took
155-345 ms where the same step took ~105 ms once the memory had been used before, the running
streams' longest gap of the prefill (4-6x their steady gap) in the first long prompt an engine
served (the long-prompt benchmark's first trial), and 3.5x on the 0.5B model's ending step.

`JoinReserve` allocates the joined tensors while the prompt is still being prefilled, a few
layers after each of its paced steps (whose length the clock bounds, `LayerDeadline`), so the
faults are spread over those steps; `join_caches` then writes into them in place (a reserved
buffer is referenced by nothing else, so MLX updates it without a copy). Only where the join
takes the process past the most memory MLX has held (`mx.get_peak_memory`): below it, the
allocator hands back pages it already has, and later joins of the same size took ~100 ms with
no faults, while buffers made ahead of every join (faulted again, beside the paced steps) made
the newcomer's prefill ~9% slower over six trials. A buffer is at least as long as the join
needs, rounded up to the cache's growth step: room past `_idx` is what a batch cache holds
anyway. The GPU backends keep freed buffers for reuse: there it stays off. (The deeper fix, a
CPU allocator that keeps freed buffers as the GPU ones do, is MLX's to make.)
"""

from __future__ import annotations

import logging
import math
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

log = logging.getLogger(__name__)

# Bytes of buffers a step makes at most (`JoinReserve`; at least one buffer): ~85M and 0.5B bench models' two layers
# (~18 MB) fit, an 8B-like KV's 126 MB a layer takes two steps (its keys, then its values).
RESERVE_BYTES_PER_STEP = 32 << 20
# Positions of room past the newcomer's end, for running rows longer than it that keep growing until the join.
RUNNING_MARGIN = 64


class JoinReserve:
    """Zeroed (keys, values) buffers per layer for one coming join, or none.

    A step makes at most `layers_per_step` layers' buffers and at most `bytes_per_step` bytes of
    them (one buffer at least, a layer's keys and values in two steps if need be). Why the bytes:
    a model with an 8B model's KV per token (8 KV heads of 128, `wide-kv` in `bench/`) joining a
    3,000-token prompt to four streams needs 126 MB a layer; two layers a step made those steps
    1.1-1.6 s against ~0.2 s (the streams' gaps 10x their steady gap) until the reserve was done.
    """

    def __init__(self, layers_per_step: int = 2, enabled: bool | None = None,
                 bytes_per_step: int = RESERVE_BYTES_PER_STEP):
        self.layers_per_step = max(1, layers_per_step)
        self.bytes_per_step = bytes_per_step
        self.enabled = mx.default_device() == mx.cpu if enabled is None else enabled
        self.uid: int | None = None
        self._shape: tuple | None = None  # (rows, size) the buffers were made for
        self._buffers: dict[int, tuple[mx.array, mx.array]] = {}
        self._keys: dict[int, mx.array] = {}  # a layer whose keys' buffer is made and values' is not yet
        self._made = 0  # buffers (two a layer) that exist, were taken, or are not needed (below the peak)

    def prepare(self, uid: int, running: list[Any], joining: list[Any], remaining: int) -> None:
        """Makes the next buffers for joining `joining` (one prompt, `remaining` tokens still to prefill) to
        `running`; starts over when the batch or the prompt changed."""
        if not self.enabled or not _batch_caches(running) or not _batch_caches(joining):
            return
        first = running[0]
        end = max(joining[0]._idx + remaining, first._idx + RUNNING_MARGIN)
        step = getattr(first, "step", 256)
        shape = (first.keys.shape[0] + joining[0].keys.shape[0], -(-end // step) * step)
        if uid != self.uid or shape != self._shape:
            self.clear()
            self.uid, self._shape = uid, shape
            joined = sum((c.keys.nbytes + c.values.nbytes) * shape[0] * shape[1] // (c.keys.shape[0] * c.keys.shape[2])
                         for c in running)
            self._made = 2 * len(running) if mx.get_active_memory() + joined <= mx.get_peak_memory() else 0
        made: list[mx.array] = []
        made_bytes = 0
        with mx.stream(mx.default_stream(mx.cpu)):  # beside the generation stream's pass, not queued behind it
            while self._made < 2 * len(running) and len(made) < 2 * self.layers_per_step:
                layer, values = divmod(self._made, 2)
                held = running[layer].values if values else running[layer].keys
                size = (shape[0], held.shape[1], shape[1], held.shape[3])
                made_bytes += held.itemsize * math.prod(size)
                if made and made_bytes > self.bytes_per_step:
                    break
                buffer = mx.zeros(size, dtype=held.dtype)
                if values:
                    self._buffers[layer] = (self._keys.pop(layer), buffer)
                else:
                    self._keys[layer] = buffer
                made.append(buffer)
                self._made += 1
        if made:
            mx.async_eval(made)
            log.debug("join reserve: %d buffers, %.0f MB; %d of %d layers ready", len(made),
                      sum(buffer.nbytes for buffer in made) / 1e6, len(self._buffers), len(running))

    def take(self, layer: int, rows: int, end: int, keys: mx.array,
             values: mx.array) -> tuple[mx.array, mx.array] | None:
        """This layer's reserved (keys, values), if they fit a join of `rows` rows ending at `end`; never twice."""
        pair = self._buffers.pop(layer, None)
        if pair is None:
            return None
        for buffer, like in zip(pair, (keys, values)):
            if (buffer.shape[0] != rows or buffer.shape[1] != like.shape[1] or buffer.shape[2] < end
                    or buffer.shape[3] != like.shape[3] or buffer.dtype != like.dtype):
                return None
        return pair

    def forget(self, uids: Any) -> None:
        """Drops the buffers of a prompt that left before joining."""
        if self.uid is not None and self.uid in uids:
            self.clear()

    def clear(self) -> None:
        """Lets go of every buffer (after a join, or when the prompt or the batch changed)."""
        self.uid, self._shape, self._buffers, self._keys, self._made = None, None, {}, {}, 0

    @property
    def layers_ready(self) -> int:
        """Layers whose buffers wait for the join."""
        return len(self._buffers)


def _batch_caches(caches: list[Any]) -> bool:
    """Plain batch caches with KV in them: the only ones `join_caches` joins (quantized keys are tuples)."""
    return bool(caches) and all(type(c) is BatchKVCache and c.keys is not None for c in caches)
