"""Sizes prompt chunks so prefill never stalls running streams for long.

While requests decode, every step also prefills a chunk of the waiting prompts.
A chunk of n prompt tokens adds about `a + b*n` seconds to the step: `a` is paid
once per model call (reading the weights), `b` per token. The pacer fits that line
from the steps it has seen and picks n so a step with prefill costs about `ratio`
decode steps more than one without. Inter-token latency of running streams stays
near `1 + ratio` times its steady state, and a fast accelerator (cheap prefill)
still gets large chunks.

Pacing protects the streams that are running at the expense of the prompts that
wait, so (unless the operator fixed the chunk) it only applies while the streams
are at least as many as the waiting prompts. When more clients wait for a first token than are streaming (a burst of
requests lands just after one started), the waiting prompts are prefilled at full
speed: a few streams pause once instead of many clients waiting through dozens of
slowed steps, and prefilling big chunks wastes no model calls.
"""

from __future__ import annotations

from collections import deque


class PrefillPacer:
    def __init__(self, fixed: int | None, maximum: int, minimum: int = 8, ratio: float = 1.0,
                 smoothing: float = 0.3, window: int = 32):
        self.fixed = fixed
        self.maximum = maximum
        self.minimum = minimum
        self.ratio = ratio
        self.smoothing = smoothing
        self.decode_seconds: float | None = None
        # (prompt tokens, seconds the prefill added to its step), most recent last
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def chunk(self, decoding: int, prefilling: int) -> int:
        """Prompt tokens each of the `prefilling` requests may process in the next step, while `decoding` stream."""
        if not decoding:
            return self.maximum  # nobody to stall: prefill at full speed
        if self.fixed:
            return self.fixed  # the operator's --interleave-prefill-tokens
        if decoding < prefilling:
            return self.maximum  # more clients wait for a first token than stream: serve them first
        if self.decode_seconds is None or not self.samples:
            return self.minimum
        budget = self.ratio * self.decode_seconds
        line = self._fit()
        if line is not None:
            fixed_cost, per_token = line
            total = (budget - fixed_cost) / per_token
        else:
            # One chunk size seen so far: assume it was all per-token cost (cautious), and try a
            # larger chunk once so the next fit can tell the fixed cost from the per-token cost.
            tokens, seconds = self.samples[-1]
            total = max(budget / (seconds / tokens), 2 * tokens)
        return int(max(self.minimum, min(self.maximum, round(total / max(1, prefilling)))))

    def observe(self, step_seconds: float, decoding: bool, prompt_tokens: int) -> None:
        """Learns from one finished step: its time, whether it decoded, how many prompt tokens it took."""
        if prompt_tokens == 0:
            if decoding:
                old = self.decode_seconds
                self.decode_seconds = step_seconds if old is None else old + self.smoothing * (step_seconds - old)
            return
        if decoding and self.decode_seconds is None:
            return  # cannot tell the prefill's share of this step yet
        extra = step_seconds - (self.decode_seconds if decoding else 0.0)
        self.samples.append((prompt_tokens, max(extra, 1e-6)))

    def _fit(self) -> tuple[float, float] | None:
        """Least-squares `seconds = a + b * tokens`, or None without two distinct chunk sizes."""
        n = len(self.samples)
        xs = [float(t) for t, _ in self.samples]
        ys = [s for _, s in self.samples]
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        var = sum((x - mean_x) ** 2 for x in xs)
        if var == 0:
            return None
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
        if slope <= 0:
            return None
        return max(0.0, mean_y - slope * mean_x), slope
