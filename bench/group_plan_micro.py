"""Per-tick cost of the step-plan broadcast (`PlanChannel.exchange`) between two ranks over loopback.

Run under mlx.launch; rank 0 prints the figures. Three plan shapes: a decode tick (no ops:
the common case, one all_sum of the 128-byte header), a tick that admits a 1,000-token
prompt (two all_sums), and, for scale, a bare all_sum of one float32 (the least a collective
costs on this backend).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        mlx.launch --backend ring --hosts 127.0.0.1 -n 2 -- "$(which python)" bench/group_plan_micro.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine_daemon.group.plan import AddOp, StepPlan  # noqa: E402
from engine_daemon.group.wire import PlanChannel  # noqa: E402

ITERATIONS = 2000


def timed(fn, iterations: int = ITERATIONS) -> dict[str, float]:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e6)
    samples.sort()
    return {"median_us": round(statistics.median(samples), 1), "p90_us": round(samples[int(len(samples) * 0.9)], 1),
            "mean_us": round(statistics.fmean(samples), 1)}


def main() -> int:
    group = mx.distributed.init(strict=True)
    stream = mx.default_stream(mx.default_device())
    channel = PlanChannel(group, stream)
    leader = group.rank() == 0
    decode = StepPlan(123456, [], prefill_step_size=2048, step=True).encode()
    admit = StepPlan(123457, [("add", AddOp(17, list(range(1000, 2000)), 256, {"temperature": 0.7, "seed": 2**62},
                                           [151643, 151645]))], prefill_step_size=2048, step=True).encode()
    one = mx.array([1.0])
    results = {
        "decode_tick_plan_bytes": len(decode),
        "decode_tick": timed(lambda: channel.exchange(decode if leader else None)),
        "admit_1000_token_prompt_plan_bytes": len(admit),
        "admit_1000_token_prompt": timed(lambda: channel.exchange(admit if leader else None), 500),
        "bare_all_sum_float32": timed(lambda: mx.eval(mx.distributed.all_sum(one, group=group, stream=stream))),
    }
    if leader:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
