"""Sizes prompt chunks so prefill never stalls running streams for long.

While requests decode, every step also prefills a chunk of the waiting prompts.
The pacer measures what a decode step and a prefilled token cost on this machine
and picks the chunk so that a step with prefill costs about `ratio` decode steps
more than one without: inter-token latency stays near its steady state, and a
fast accelerator (cheap prefill) still gets big chunks.
"""

from __future__ import annotations


class PrefillPacer:
    def __init__(self, fixed: int | None, maximum: int, minimum: int = 8, ratio: float = 1.0,
                 smoothing: float = 0.3):
        self.fixed = fixed
        self.maximum = maximum
        self.minimum = minimum
        self.ratio = ratio
        self.smoothing = smoothing
        self.decode_seconds: float | None = None
        self.seconds_per_prompt_token: float | None = None

    def chunk(self, decoding: bool, prefilling: int) -> int:
        """Prompt tokens each prefilling request may process in the next step."""
        if not decoding:
            return self.maximum  # nobody to stall: prefill at full speed
        if self.fixed:
            return self.fixed
        if self.decode_seconds is None or self.seconds_per_prompt_token is None:
            return self.minimum
        budget = self.ratio * self.decode_seconds / self.seconds_per_prompt_token
        return int(max(self.minimum, min(self.maximum, round(budget / max(1, prefilling)))))

    def observe(self, step_seconds: float, decoding: bool, prompt_tokens: int) -> None:
        """Learns from one finished step: its time, whether it decoded, how many prompt tokens it took."""
        if prompt_tokens == 0:
            if decoding:
                self.decode_seconds = self._blend(self.decode_seconds, step_seconds)
            return
        if decoding and self.decode_seconds is None:
            return  # cannot tell the prefill's share of this step yet
        prefill_seconds = step_seconds - (self.decode_seconds if decoding else 0.0)
        per_token = max(prefill_seconds, 1e-6) / prompt_tokens
        self.seconds_per_prompt_token = self._blend(self.seconds_per_prompt_token, per_token)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
