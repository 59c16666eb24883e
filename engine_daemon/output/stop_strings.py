"""Stop strings matched on decoded text, with hold-back, in time linear in the text.

A stop string can span several tokens. Text that might be the beginning of a
stop string is held back until the next token settles it, so a partial stop
string is never streamed to a client.

Each stop string has a Knuth-Morris-Pratt automaton whose state is the length of the
longest prefix of the stop string that ends the text seen so far: every new character
costs O(1) amortised per stop string, whatever the client sent (a naive suffix scan was
quadratic in the held-back text, and 16 long stop strings slowed every other stream).
Generation stops at the first character that completes a stop string; the text before
that stop string is released, the held-back text is the longest live prefix.
"""

from __future__ import annotations

# Bounds the engine enforces at admission (the front-end checks the same ones first).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters


class _StopAutomaton:
    """KMP matcher of one stop string over a stream of characters."""

    def __init__(self, stop: str):
        self.stop = stop
        self.state = 0  # length of the longest prefix of `stop` that ends the text fed so far
        self.fail = [0] * len(stop)  # KMP prefix function
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def advance(self, char: str) -> bool:
        """Feeds one character; True when it completes the stop string."""
        state = self.state
        while state and self.stop[state] != char:
            state = self.fail[state - 1]
        if self.stop[state] == char:
            state += 1
        self.state = state
        return state == len(self.stop)


class StopStringMatcher:
    """Feeds decoded text in, hands out the text that is safe to send."""

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self._automata = [_StopAutomaton(stop) for stop in self.stops]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Returns the text that can be sent now; sets `matched` when a stop string hit."""
        if not self.stops:
            return text
        if self.matched is not None:
            return ""
        buffer = self._held + text
        start = len(self._held)  # the held characters were fed to the automata already
        for offset, char in enumerate(text):
            completed = [automaton.stop for automaton in self._automata if automaton.advance(char)]
            if completed:
                self.matched = max(completed, key=len)  # the same end: the longest began first
                self._held = ""
                return buffer[:start + offset + 1 - len(self.matched)]
        hold = max(automaton.state for automaton in self._automata)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        """At the end of generation nothing more can complete a stop string: release the rest."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
