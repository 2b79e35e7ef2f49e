"""Stop strings over streamed text: hold back what could still become a stop, cut at a match."""

from __future__ import annotations


class StopMatcher:
    """Feeds detokenized text through; returns what is safe to emit and whether a stop hit.

    A stop string may span tokens, so any tail of the text that is a prefix of a stop
    string is held back until the next token decides it. The stop itself is never emitted.
    """

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text that can be emitted now; sets `stopped` on a match."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        cut = self._first_match(buffer)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._held_back(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Returns whatever was held back (the request ended without a match)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, buffer: str) -> int | None:
        found = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _held_back(self, buffer: str) -> int:
        """Returns the length of the longest tail of `buffer` that starts some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
