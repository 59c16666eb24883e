"""How many prompt tokens a generator step processed, from the cumulative progress mlx-lm reports per prompt."""

from __future__ import annotations

from typing import Any


class PromptProgress:
    """Per prompt uid, the tokens processed so far: a step's share is the difference.

    A chunk cut between layers and rolled back (`LayerCarry`) is processed again, so a
    prompt's count can fall: that step's share is then 0, not negative.
    """

    def __init__(self) -> None:
        self._processed: dict[int, int] = {}

    def step_tokens(self, progress: list[Any]) -> int:
        """Prompt tokens the last step processed (`PromptProcessingBatch.Response`s of the step)."""
        done = 0
        for response in progress:
            processed = response.progress[0]
            done += processed - self._processed.get(response.uid, 0)
            if response.end_of_prompt:
                self._processed.pop(response.uid, None)
            else:
                self._processed[response.uid] = processed
        return max(0, done)

    def forget(self, uid: int) -> None:
        self._processed.pop(uid, None)

    def clear(self) -> None:
        self._processed.clear()
