"""An in-process cache tier: key -> value, least recently used first out, under a byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LruTier(Generic[T]):
    """Thread-safe LRU map that never holds more than `budget_bytes`.

    `put` and `resize` return what they evicted, so the caller can demote it to the
    next tier instead of losing it.
    """

    def __init__(self, name: str, budget_bytes: int):
        self.name = name
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.hits = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, tuple[T, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> T | None:
        """Returns the value of `key` and marks it most recently used; None when absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def touch(self, key: bytes) -> None:
        """Marks `key` most recently used, if present (not counted as a hit)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def put(self, key: bytes, value: T, nbytes: int) -> list[tuple[bytes, T]]:
        """Stores `value`; returns the evicted entries (or this one, if it can never fit)."""
        if nbytes > self.budget_bytes:
            return [(key, value)]
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (value, nbytes)
            self.bytes += nbytes
            return self._evict_to(self.budget_bytes)

    def values(self) -> list[T]:
        """Returns a snapshot of the values, least recently used first."""
        with self._lock:
            return [v for v, _ in self._entries.values()]

    def pop(self, key: bytes) -> T | None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self.bytes -= entry[1]
            return entry[0]

    def resize(self, budget_bytes: int) -> list[tuple[bytes, T]]:
        """Sets the budget; returns what a lower budget evicted at once."""
        with self._lock:
            self.budget_bytes = budget_bytes
            return self._evict_to(budget_bytes)

    def remove_if(self, predicate: Callable[[T], bool]) -> int:
        """Removes every entry whose value matches; returns how many."""
        with self._lock:
            doomed = [k for k, (v, _) in self._entries.items() if predicate(v)]
            for k in doomed:
                self.bytes -= self._entries.pop(k)[1]
            return len(doomed)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget_bytes": self.budget_bytes, "blocks": len(self._entries),
                "hits": self.hits, "evictions": self.evictions}

    def _evict_to(self, limit: int) -> list[tuple[bytes, T]]:
        evicted = []
        while self.bytes > limit and self._entries:
            key, (value, nbytes) = self._entries.popitem(last=False)
            self.bytes -= nbytes
            self.evictions += 1
            evicted.append((key, value))
        return evicted
