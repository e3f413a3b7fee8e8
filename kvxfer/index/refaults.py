"""Refaults: blocks stored again soon after a tier evicted them (Linux's workingset refaults).

A full tier evicts all the time, healthy or not; what tells thrashing from turnover is whether
the blocks it evicts come back. The index remembers the keys of its recent evictions (64-bit
hashes, not bytes) and counts a key stored again while remembered: with the window the tier's
capacity, that block was reused within about one capacity's worth of evictions, so a tier about
twice as big would have kept it. Refaults over evictions near 0 is a steady cache; near 1,
everything it evicts is wanted again (``KvxferTierThrashing``).

Two generations of hashes in sets, not a queue: a key is remembered for between ``window`` and
twice that many evictions, and every step is one bulk set operation (per-key Python tripled the
bookkeeping of a full tier's offload).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: At most this many evictions in a generation (two generations: about 10 MB at most).
MAX_WINDOW = 1 << 16


def _hashes(namespace: str, keys: Sequence[bytes]) -> list[int]:
    """(namespace, key) as one 64-bit hash each (a collision only miscounts a statistic)."""
    return (np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)) ^ hash(namespace)).tolist()


class Refaults:
    """The keys of recent evictions and the count of those stored again. Not thread-safe: the index
    calls it under its lock."""

    def __init__(self, window: int) -> None:
        self.window = max(1, min(window, MAX_WINDOW))
        self._current: set[int] = set()
        self._previous: set[int] = set()
        self.count = 0

    def evicted(self, namespaces: Sequence[str], keys: Sequence[bytes]) -> None:
        """``keys[i]`` of ``namespaces[i]`` left the tier (``namespaces`` of one name: all of them)."""
        if len(namespaces) == 1:
            self._current.update(_hashes(namespaces[0], keys))
        else:
            self._current.update(hash(ns) ^ hash(key) for ns, key in zip(namespaces, keys))
        if len(self._current) >= self.window:  # a new generation; the oldest is forgotten
            self._previous, self._current = self._current, set()

    @property
    def remembers(self) -> bool:
        """Whether any eviction is remembered (else a store has nothing to look up)."""
        return bool(self._current or self._previous)

    def stored(self, namespace: str, keys: Sequence[bytes]) -> None:
        """``keys`` were not in the tier and are stored now."""
        if not self.remembers:  # nothing evicted yet: the usual case costs nothing
            return
        hashes = set(_hashes(namespace, keys))
        for generation in (self._current, self._previous):
            back = generation & hashes
            if back:
                self.count += len(back)
                generation -= back
                hashes -= back
