"""Warns when MLX on the CPU runs on the bundled reference BLAS.

The Linux `mlx[cpu]` wheel links a reference BLAS that multiplies float32
matrices ~40x slower than OpenBLAS; preloading Debian's libopenblas0-pthread
(LD_PRELOAD=/usr/lib/<arch>/openblas-pthread/libblas.so.3) fixes it. A short
timed matmul tells the two apart on any platform without inspecting the process.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

log = logging.getLogger(__name__)

# The reference BLAS manages ~4 GFLOP/s here, OpenBLAS ~190: the line sits well between.
SLOW_GFLOPS = 25.0


def measure_matmul_gflops(size: int = 512, repeats: int = 3) -> float:
    a = mx.random.normal((size, size), dtype=mx.float32)
    b = mx.random.normal((size, size), dtype=mx.float32)
    mx.eval(a @ b)  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    elapsed = (time.perf_counter() - started) / repeats
    return 2 * size**3 / elapsed / 1e9


def warn_if_slow_blas() -> float | None:
    """Logs a warning on a slow CPU BLAS; returns the GFLOP/s measured (None on a GPU)."""
    if mx.default_device() != mx.cpu:
        return None
    gflops = measure_matmul_gflops()
    if gflops < SLOW_GFLOPS:
        log.warning(
            "MLX runs on the CPU at %.1f GFLOP/s (float32 matmul): this looks like the bundled "
            "reference BLAS. Preload OpenBLAS for ~40x faster CPU inference, e.g. "
            "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 "
            "(Debian/Ubuntu package libopenblas0-pthread).", gflops)
    else:
        log.info("CPU float32 matmul: %.1f GFLOP/s", gflops)
    return gflops
