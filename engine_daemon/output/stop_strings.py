"""Stop strings matched on decoded text, with hold-back.

A stop string can span several tokens. Text that might be the beginning of a
stop string is held back until the next token settles it, so a partial stop
string is never streamed to a client.
"""

from __future__ import annotations


class StopStringMatcher:
    """Feeds decoded text in, hands out the text that is safe to send."""

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Returns the text that can be sent now; sets `matched` when a stop string hit."""
        if not self.stops:
            return text
        if self.matched is not None:
            return ""
        buffer = self._held + text
        first_hit = -1
        for stop in self.stops:
            index = buffer.find(stop)
            if index != -1 and (first_hit == -1 or index < first_hit):
                first_hit, self.matched = index, stop
        if first_hit != -1:
            self._held = ""
            return buffer[:first_hit]
        hold = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """At the end of generation nothing more can complete a stop string: release the rest."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
