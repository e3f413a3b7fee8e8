"""Eviction policies: which complete, unpinned entry leaves a full tier first.

The index holds exactly the evictable entries (ready and unpinned) in its policy;
a policy only orders them. LRU today; a policy is one small class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable


class EvictionPolicy(ABC):
    """An ordered set of evictable entries."""

    @abstractmethod
    def add(self, entry: Hashable) -> None:
        """The entry became evictable (or was used again while evictable)."""

    @abstractmethod
    def discard(self, entry: Hashable) -> None:
        """The entry is no longer evictable (pinned, dropped); absent entries are ignored."""

    @abstractmethod
    def victim(self) -> Hashable | None:
        """Remove and return the entry to evict next, or None if there is none."""

    @abstractmethod
    def ordered(self) -> list[Hashable]:
        """Every entry, the next victim first."""

    @abstractmethod
    def __contains__(self, entry: Hashable) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


class LRU(EvictionPolicy):
    """Least recently used first: an entry is used when stored and when loaded."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, entry: Hashable) -> None:
        self._order[entry] = None
        self._order.move_to_end(entry)

    def discard(self, entry: Hashable) -> None:
        self._order.pop(entry, None)

    def victim(self) -> Hashable | None:
        return self._order.popitem(last=False)[0] if self._order else None

    def ordered(self) -> list[Hashable]:
        return list(self._order)

    def __contains__(self, entry: Hashable) -> bool:
        return entry in self._order

    def __len__(self) -> int:
        return len(self._order)
