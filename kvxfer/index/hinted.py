"""The eviction order with hints: released blocks first, then least recently used, retained blocks last.

Engines, routers and applications know what the daemon cannot: that a session ended (its blocks
are dead unless someone else reads them) or that a block will be needed soon. ``HintedLRU`` keeps
two use orders (``kvxfer/index/_use_order.c``): the ordinary blocks' LRU order and the released blocks'
order. A victim is taken

1. from the released blocks, oldest release first;
2. else from the ordinary order, least recently used first, passing over retained blocks whose TTL
   has not passed;
3. else from the retained blocks, in the same order (retention never makes a store fail).

A read (a load, or a store of the same key) makes a released block ordinary again, at the most
recent end: a shared prefix that one session released and another still reads is not lost. With no
hints step 1 is empty and step 2 passes over nothing, so the victims are exactly ``LinkedLRU``'s.
Which step each victim came from is counted (``evicted``). Bookkeeping only: slots, never keys.
"""

from __future__ import annotations

import numpy as np

from kvxfer.core.records import EvictionReason
from kvxfer.index import eviction
from kvxfer.index.eviction import Evictable, EvictionPolicy, LinkedLRU

_NONE = np.empty(0, dtype=np.int64)


def default_policy(capacity: int) -> EvictionPolicy:
    """``HintedLRU`` where the C use order is built (else plain LRU, and hints change nothing)."""
    if eviction.USE_ORDER is not None and capacity < (1 << 32) - 1:
        return HintedLRU(capacity)
    return eviction.lru(capacity)


class HintedLRU(EvictionPolicy):
    """LRU with released blocks first and retained blocks last (module docstring). Needs the C use order."""

    def __init__(self, capacity: int) -> None:
        self._ordinary = LinkedLRU(capacity)
        self._released = LinkedLRU(capacity)
        self._is_released = np.zeros(capacity, dtype=bool)
        self.until = np.zeros(capacity, dtype=np.float64)  # retained until (time.monotonic()); 0: not retained
        self.released_count = 0
        self.retained_marks = 0  # slots with a retention set (some may have passed: ``retained``)
        self.evicted = {reason: 0 for reason in EvictionReason}
        self.now = 0.0  # the index sets it before it asks for victims (one clock read a batch)

    # -- EvictionPolicy --------------------------------------------------------------
    def used(self, slots: np.ndarray) -> None:
        if self.released_count:
            back = np.unique(slots[self._is_released[slots]])
            if back.size:  # read again: ordinary from now on
                self._released.forget(back)
                self._is_released[back] = False
                self.released_count -= len(back)
        self._ordinary.used(slots)

    def forget(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        self._ordinary.forget(slots)
        self._clear(slots)

    def victims(self, n: int, evictable: Evictable) -> np.ndarray:
        taken = []
        if self.released_count and n > 0:
            released = self._released.victims(n, evictable)
            self._take(released, EvictionReason.RELEASED, taken)
            n -= len(released)
        if n > 0 and not self.retained_marks:
            self._take(self._ordinary.victims(n, evictable), EvictionReason.LRU, taken)
        elif n > 0:
            ordinary = self._ordinary.victims(n, self._narrowed(evictable, retained=False))
            self._take(ordinary, EvictionReason.LRU, taken)
            n -= len(ordinary)
            if n > 0:
                self._take(self._ordinary.victims(n, self._narrowed(evictable, retained=True)),
                           EvictionReason.RETAINED, taken)
        return np.concatenate(taken) if len(taken) > 1 else taken[0] if taken else _NONE

    def ordered(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        released = self._is_released[slots]
        if not released.any():
            return self._ordinary.ordered(slots)
        return np.concatenate([self._released.ordered(slots[released]), self._ordinary.ordered(slots[~released])])

    # -- hints ---------------------------------------------------------------------
    def release(self, slots: np.ndarray) -> None:
        """These (distinct, complete) slots go to the eviction front, their retention ended."""
        slots = slots[~self._is_released[slots]]
        self._unretain(slots)
        if slots.size:
            self._ordinary.forget(slots)
            self._released.used(slots)
            self._is_released[slots] = True
            self.released_count += len(slots)

    def retain(self, slots: np.ndarray, until: float) -> None:
        """These (distinct, complete) slots are evicted last until ``until`` (the later of two retentions holds);
        a released one is ordinary again."""
        if not slots.size:
            return
        if self.released_count and self._is_released[slots].any():
            self.used(slots[self._is_released[slots]])
        self.retained_marks += int(np.count_nonzero(self.until[slots] == 0))
        self.until[slots] = np.maximum(self.until[slots], until)

    def retained(self, slots: np.ndarray, now: float) -> np.ndarray:
        """Whether each slot's retention holds at ``now``."""
        return self.until[slots] > now

    def expire(self, now: float) -> np.ndarray:
        """Clear retentions that have passed (O(capacity): the index calls it only when a share is full);
        returns their slots."""
        passed = np.flatnonzero((self.until > 0) & (self.until <= now))
        self._unretain(passed)
        return passed

    def retained_now(self, now: float) -> int:
        return int(np.count_nonzero(self.until > now)) if self.retained_marks else 0

    # -- internals -------------------------------------------------------------------
    def _narrowed(self, evictable: Evictable, retained: bool) -> Evictable:
        """``evictable`` asked only of slots whose retention holds (``retained``) or does not: a tenant's
        ``evictable`` spends its budget on what it allows, so it must see only what may be taken."""
        def allowed(slots: np.ndarray) -> np.ndarray:
            mask = np.zeros(len(slots), dtype=bool)
            which = (self.until[slots] > self.now) == retained
            if which.any():
                mask[which] = evictable(slots[which])
            return mask
        return allowed

    def _take(self, victims: np.ndarray, reason: EvictionReason, taken: list) -> None:
        if victims.size:
            self._clear(victims)
            self.evicted[reason] += len(victims)
            taken.append(victims)

    def _unretain(self, slots: np.ndarray) -> None:
        if self.retained_marks and slots.size:
            self.retained_marks -= int(np.count_nonzero(self.until[slots]))
            self.until[slots] = 0

    def _clear(self, slots: np.ndarray) -> None:
        """These slots hold no entry any more: neither released nor retained."""
        if self.released_count:
            gone = np.unique(slots[self._is_released[slots]])
            if gone.size:
                self._released.forget(gone)
                self._is_released[gone] = False
                self.released_count -= len(gone)
        self._unretain(slots)
