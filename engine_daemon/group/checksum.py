"""A running checksum of the tokens each rank's generator produced, compared every N ticks.

Why: ranks sample on their own (same logits, same seeded keys); if they ever disagree
(a numeric difference, an unseeded draw) the followers would feed different tokens into
their KV caches and the group would produce garbage silently. The comparison turns
that into a loud failure (`GroupFailed`).
"""

from __future__ import annotations

from collections.abc import Iterable

MODULUS = 2**31 - 1  # fits the int32 slot of `PlanChannel.agree`


class TokenChecksum:
    def __init__(self) -> None:
        self.value = 0
        self.tokens = 0

    def observe(self, uid_tokens: Iterable[tuple[int, int]]) -> None:
        """Folds one step's (uid, token) pairs in, in uid order (every rank sees the same set)."""
        for uid, token in sorted(uid_tokens):
            self.value = (self.value * 1_000_003 + uid * 7919 + token + 1) % MODULUS
            self.tokens += 1


def mismatched_ranks(values: list[int]) -> list[int]:
    """Ranks whose checksum differs from rank 0's."""
    return [rank for rank, value in enumerate(values) if value != values[0]]
