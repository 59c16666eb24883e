"""Which work on the CPU is a prompt's, and a second thread for the NumPy parts of it.

Why: MLX's x86 build runs `exp` one element at a time (~12 ns per element here, NumPy's
AVX2/AVX-512 `exp` ~0.5 ns), and a prompt's prefill takes `exp` of every attention score
and of every SwiGLU gate. `prefill_attention` and `prefill_swiglu` compute those in NumPy,
which needs the inputs evaluated first: a synchronisation per layer that a prompt's large
chunk pays for many tokens at once but a decode step, which MLX evaluates asynchronously
while the next step is built, should not pay at all. So only work marked as a prompt's
takes those paths: mlx-lm's `PromptProcessingBatch.prompt` (wrapped by
`prefill_attention.install`) and the chunk's share of a fused step (`fused_forward`).
A prompt token is then computed the same way whichever chunk or step it lands in.
(A decode step at a long context takes the attention path too, `decode_attention`: there its
scores are many enough that the stop costs less than MLX's `exp`.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import mlx.core as mx

_local = threading.local()
_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-numpy")

Part = TypeVar("Part")


@contextlib.contextmanager
def prefilling() -> Iterator[None]:
    """Marks the work computed inside as a prompt's (this thread only; nests)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def active() -> bool:
    """Whether this thread is computing a prompt's work (`prefilling`)."""
    return getattr(_local, "depth", 0) > 0


def in_two(work: Callable[[Part], None], first: Part, second: Part) -> None:
    """Runs `work` on `second` in the helper thread and on `first` here (NumPy's loops let go of the GIL)."""
    pending = _pool.submit(work, second)
    work(first)
    pending.result()


class PathSwitch:
    """The operator's `numpy`/`mlx` choice for one of the CPU's NumPy paths (`--cpu-prefill-attention`,
    `--cpu-decode-attention`, `--cpu-prefill-swiglu`): each path module keeps one and checks `on` in its `claims`."""

    def __init__(self) -> None:
        self.on = True

    def configure(self, enabled: bool) -> None:
        """Whether this path takes the work it claims (the flag's value is `numpy`)."""
        self.on = bool(enabled)

    def enabled(self) -> bool:
        """Whether this path is on here and now (off on a GPU), for /stats."""
        return self.on and mx.default_device() == mx.cpu
