"""Thinking blocks: where a prompt leaves the model, and the `thinking_budget` cap.

A chat template either leaves the generation prompt inside an open `<think>`
block (the model reasons first) or closes it (`enable_thinking: false`). The
budget is a logits processor: once a request has spent `budget` tokens inside
the block it forces the model's think-end token sequence, after which the model
continues with its answer (Qwen's documented way to cap thinking).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx


def prompt_in_thinking(tokenizer: Any, prompt_tokens: Sequence[int]) -> bool:
    """True when the prompt ends inside an open thinking block."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    tokens = list(prompt_tokens)
    # Only the tail matters: the generation prompt is the last few tokens.
    tail_start = max(0, len(tokens) - 16)
    start = tokenizer.rfind_think_start(tokens, start=tail_start)
    end = tokenizer.rfind_think_end(tokens, start=tail_start)
    return start >= 0 and start > end


def _only(token: int, logits: mx.array) -> mx.array:
    allowed = mx.arange(logits.shape[-1]) == token
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


class ThinkingBudget:
    """Logits processor (mlx-lm signature) that closes the thinking block after `budget` tokens.

    It learns each newly sampled token from the last entry of `tokens`, which both
    mlx-lm's BatchGenerator and generate_step pass (prompt context + generated).
    """

    def __init__(self, start_tokens: Sequence[int], end_tokens: Sequence[int], budget: int, in_thinking: bool):
        self.start = tuple(start_tokens)
        self.end = tuple(end_tokens)
        self.budget = max(0, budget)
        self.in_thinking = in_thinking
        self.spent = 0
        self.forced = 0  # how many think-end tokens have been forced so far
        self.recent: list[int] = []
        self.calls = 0

    def _observe(self, token: int) -> None:
        self.recent = (self.recent + [token])[-max(len(self.start), len(self.end)):]
        if self.in_thinking:
            self.spent += 1
            if tuple(self.recent[-len(self.end):]) == self.end:
                self.in_thinking, self.forced = False, 0
        elif tuple(self.recent[-len(self.start):]) == self.start:
            self.in_thinking, self.spent = True, 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.calls:
            self._observe(int(tokens[-1].item()))
        self.calls += 1
        if not self.in_thinking or self.spent < self.budget:
            return logits
        # Over budget: emit the end sequence, continuing a partial one the model began itself.
        done = 0
        for size in range(min(len(self.end) - 1, len(self.recent)), 0, -1):
            if tuple(self.recent[-size:]) == self.end[:size]:
                done = size
                break
        return _only(self.end[done], logits)


def make_thinking_budget(tokenizer: Any, budget: int | None, in_thinking: bool) -> ThinkingBudget | None:
    """The processor for a request's `thinking_budget`, or None when it does not apply."""
    if budget is None or not getattr(tokenizer, "has_thinking", False):
        return None
    return ThinkingBudget(tokenizer.think_start_tokens, tokenizer.think_end_tokens, budget, in_thinking)
