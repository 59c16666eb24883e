"""A prompt's SwiGLU gate (`silu(gate) * up`) on the CPU, with its `exp` done by NumPy.

Why: the gate takes one `exp` per element of the MLP's hidden width for every token, and
MLX's x86 build runs `exp` one element at a time (`prefill_scope`). On the ~85M bench
model (2,304-wide MLP) that made SwiGLU 14% of a 512-token chunk and ~20% of a fused
step's 48 rows, where mlx-lm's compiled kernel took 1.0 ms per layer even split over two
streams; NumPy takes 0.15 ms (0.58 -> 0.13 ms per layer and token row count 512: 11.1 ->
1.3 ms). In a fused step the saving falls on the step that carries a few prompt tokens
beside running streams, which is what bounds a newcomer's first token there.

Only a prompt's work takes this path (`prefill_scope.prefilling`); decode steps keep
mlx-lm's kernel and its asynchronous evaluation. Results equal mlx-lm's to float rounding
(~1e-7 relative), not bitwise: `--cpu-prefill-swiglu mlx` keeps mlx-lm's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine_daemon.cpu.prefill_scope import PathSwitch, active, in_two

# From this many elements the work is shared with a second thread (its hand-off costs ~50 us).
SPLIT_ELEMENTS = 1 << 15

switch = PathSwitch()  # --cpu-prefill-swiglu
configure, enabled = switch.configure, switch.enabled


def claims(gate: mx.array, up: mx.array) -> bool:
    """Whether `swiglu` computes this call: a prompt's float32 gate on the CPU."""
    if not (switch.on and active()) or gate.shape != up.shape or gate.ndim == 0:
        return False
    return gate.dtype == up.dtype == mx.float32 and mx.default_device() == mx.cpu


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up = gate * up / (1 + exp(-gate)), evaluated now."""
    mx.eval(gate, up)
    width = gate.shape[-1]
    gates, ups = np.asarray(gate).reshape(-1, width), np.asarray(up).reshape(-1, width)
    out = np.empty(gates.shape, dtype=np.float32)

    def rows(part: slice) -> None:
        denominator = np.negative(gates[part])
        np.exp(denominator, out=denominator)  # overflows to inf for a very negative gate: the product is then 0
        denominator += 1.0
        np.multiply(gates[part], ups[part], out=out[part])
        out[part] /= denominator

    count = gates.shape[0]
    if count >= 2 and gates.size >= SPLIT_ELEMENTS:
        in_two(rows, slice(0, count // 2), slice(count // 2, count))
    else:
        rows(slice(0, count))
    return mx.array(out).reshape(gate.shape)
