"""Requests sent together start together: a short wait when a request wakes an idle engine.

Why: clients that fire several requests at once (a benchmark's eight clients, an agent's
parallel sub-tasks, a chat UI) reach the engine a few ms apart: the front-end renders and
tokenizes each in turn. The first woke the idle engine and was prefilled alone; the rest
waited for that step (~1 s for a ~150-token prompt on the 0.5B CPU model), were prefilled
together after it, and joined the decode batch a dozen steps behind the first. That
stagger then repeats for good: the first stream finishes first, its client's next request
is paced beside the seven still running, and every wave pays the first arrival's separate
prefill, its hold steps and its one-row decode passes. Measured on the 0.5B model at eight
clients (the `compare` benchmark), eight requests reached the engine within 7 ms; waiting until
8 ms pass with no new arrival took ours from 0.98x to 1.03-1.04x mlx_lm.server's throughput.

The wait is only worth it for a long first step: a prompt whose prefill is expected to take
at least `COALESCE_FACTOR` windows (so the wait costs it at most ~5% of its first token),
from the measured prefill speed; before any is measured, a prompt of `UNMEASURED_MINIMUM`
tokens or more. A short chat turn never waits.
"""

from __future__ import annotations

# A prefill expected to last at least this many windows is worth waiting one window for.
COALESCE_FACTOR = 20
# With no prefill speed measured yet, prompts this long wait (one wait at most, until a prefill is measured).
UNMEASURED_MINIMUM = 64


def worth_coalescing(uncached_tokens: int, seconds_per_token: float | None, window: float) -> bool:
    """Whether to wait up to `window` seconds for more requests before prefilling `uncached_tokens`."""
    if window <= 0 or uncached_tokens <= 0:
        return False
    if seconds_per_token is None:
        return uncached_tokens >= UNMEASURED_MINIMUM
    return uncached_tokens * seconds_per_token >= COALESCE_FACTOR * window
