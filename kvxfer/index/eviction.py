"""Eviction policies: which complete, unpinned slot of a full tier is reused first.

A policy sees slots, never keys or bytes, in batches (numpy arrays), so that a
request of 10,000 blocks costs a few vector operations instead of 10,000 calls.
The index tells it which slots were used (became evictable, or were used again);
when room is needed it names victims among the slots the index says are
evictable right now, and tells it which slots stopped being entries (deleted, dropped).
LRU today (``lru``: in C where it is built, else its Python twin); a policy is one small class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from kvxfer.core.c_modules import load

USE_ORDER = load("kvxfer.index._use_order")  # the linked LRU order in C (_use_order.c), or None
MAX_CHUNK = 1 << 16  # slots ``LinkedLRU.victims`` reads from its order at once, at most
#: Given slots, whether each may be evicted now (complete and unpinned).
Evictable = Callable[[np.ndarray], np.ndarray]


class EvictionPolicy(ABC):
    """An order over a tier's slots."""

    @abstractmethod
    def used(self, slots: np.ndarray) -> None:
        """These slots (in this order) were stored, loaded or otherwise used just now."""

    @abstractmethod
    def forget(self, slots: np.ndarray) -> None:
        """These slots hold no entry any more (until used again)."""

    @abstractmethod
    def victims(self, n: int, evictable: Evictable) -> np.ndarray:
        """Up to ``n`` evictable slots, the next victim first; the index frees them."""

    @abstractmethod
    def ordered(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` in eviction order, the next victim first."""

    @property
    def keeps_passed_over(self) -> bool:
        """Whether a slot ``victims`` passed over (not evictable then) keeps its place. Tenants' shares need
        it: a block a share protects is passed over, yet must stay in the order."""
        return True


def lru(capacity: int) -> EvictionPolicy:
    """Least recently used first, for a tier of ``capacity`` slots."""
    return LinkedLRU(capacity) if USE_ORDER is not None and capacity < (1 << 32) - 1 else QueueLRU(capacity)


class LinkedLRU(EvictionPolicy):
    """Least recently used first: a slot is used when its block is stored and when it is loaded.

    The slots in the order of their last use, as a linked list in C (``kvxfer/index/_use_order.c``):
    a use moves a slot to the end in O(1), so nothing is ever compacted. Victims are the first
    evictable slots from the front; a slot that is not evictable now (pinned by a load) keeps
    its place, and is used again when its load completes.
    """

    def __init__(self, capacity: int) -> None:
        self._order = USE_ORDER.UseOrder(capacity)

    def used(self, slots: np.ndarray) -> None:
        if len(slots):
            self._order.used(np.ascontiguousarray(slots, dtype=np.int64))

    def forget(self, slots: np.ndarray) -> None:
        if len(slots):
            self._order.discard(np.ascontiguousarray(slots, dtype=np.int64))

    def victims(self, n: int, evictable: Evictable) -> np.ndarray:
        chosen, after, size = [], -1, max(2 * n, 256)
        while n > 0:
            chunk = np.empty(size, dtype=np.int64)
            chunk = chunk[:self._order.peek(after, chunk)]
            if not chunk.size:
                break
            picked = chunk[evictable(chunk)][:n]
            chosen.append(picked)
            n -= len(picked)
            after = int(chunk[-1])
            size = min(2 * size, MAX_CHUNK)  # (long runs passed over, as a tenant's protected share: fewer calls)
        victims = np.concatenate(chosen) if chosen else np.empty(0, dtype=np.int64)
        self.forget(victims)
        return victims

    def ordered(self, slots: np.ndarray) -> np.ndarray:
        everything = np.empty(len(self._order), dtype=np.int64)
        everything = everything[:self._order.peek(-1, everything)]
        listed = everything[np.isin(everything, slots)]
        return np.concatenate([np.setdiff1d(slots, listed), listed])  # (none is unlisted: the index uses each)


class QueueLRU(EvictionPolicy):
    """``LinkedLRU``'s Python twin, where the C module is not built.

    Each use gets a stamp from a counter and is appended to a queue of (slot, stamp);
    a queued use is current while the slot's last stamp is still its stamp. Victims
    are taken from the front of the queue, skipping uses that are no longer current
    or slots that are not evictable now (a pinned slot is used again when unpinned).

    The queue drops its stale uses without a pause: once it is three quarters full, its
    current uses are copied into a larger queue a step at a time, ``STEP`` uses for each
    use appended, while victims are still taken from the old one; when the copy has caught
    up, the new queue takes over. (Compacting all at once took 0.4 s at 10^7 slots, on
    whichever request came then.) A use copied and then consumed from the old queue comes
    back in the new one: harmless, since a slot that was skipped is used again (a new
    stamp) before it can be evicted, and a victim's stamp is cleared.
    """

    STEP = 6  # uses copied per use appended: the copy ends before the last quarter fills (needs 4)
    MIN_STEP = 1 << 10

    def __init__(self, capacity: int) -> None:
        self._stamp = np.zeros(capacity, dtype=np.int64)  # the last use of each slot (0: never)
        self._clock = 0
        self._queue_slot = np.empty(1024, dtype=np.int64)
        self._queue_stamp = np.empty(1024, dtype=np.int64)
        self._head = self._tail = 0
        self._next: tuple[np.ndarray, np.ndarray] | None = None  # the queue being filled, while copying
        self._copied = 0  # old queue positions copied so far
        self._next_tail = 0

    def forget(self, slots: np.ndarray) -> None:
        self._stamp[slots] = 0  # their queued uses are not current any more

    def used(self, slots: np.ndarray) -> None:
        n = len(slots)
        if not n:
            return
        stamps = np.arange(self._clock + 1, self._clock + 1 + n, dtype=np.int64)
        self._clock += n
        self._stamp[slots] = stamps  # a slot listed twice keeps its later stamp
        for _ in range(2):  # no room (a huge batch): finish the copy now, or one sized for this batch
            if self._tail + n <= len(self._queue_slot):
                break
            self._start_copy(n)
            self._copy(len(self._queue_slot))
        self._queue_slot[self._tail:self._tail + n] = slots
        self._queue_stamp[self._tail:self._tail + n] = stamps
        self._tail += n
        if self._next is None and self._tail * 4 >= len(self._queue_slot) * 3:
            self._start_copy(n)
        if self._next is not None:
            self._copy(max(self.STEP * n, self.MIN_STEP))

    def victims(self, n: int, evictable: Evictable) -> np.ndarray:
        chosen: list[np.ndarray] = []
        while n > 0 and self._head < self._tail:
            end = min(self._tail, self._head + max(2 * n, 256))
            slots = self._queue_slot[self._head:end]
            ok = (self._stamp[slots] == self._queue_stamp[self._head:end]) & evictable(slots)
            picked = np.flatnonzero(ok)[:n]
            # Uses before the last one picked are consumed: picked, stale or not evictable now
            # (a slot unpinned later is used again then). The rest stay queued.
            self._head = self._head + int(picked[-1]) + 1 if len(picked) == n else end
            chosen.append(slots[picked].copy())
            n -= len(picked)
        if not chosen:
            return np.empty(0, dtype=np.int64)
        victims = np.concatenate(chosen)
        self._stamp[victims] = 0  # no queued use of a victim is current any more
        return victims

    def ordered(self, slots: np.ndarray) -> np.ndarray:
        return slots[np.argsort(self._stamp[slots], kind="stable")]

    @property
    def keeps_passed_over(self) -> bool:
        return False  # consumed with the queue: a pinned slot comes back when unpinned, a protected one would not

    def _start_copy(self, room: int) -> None:
        """Begin copying the current uses into a queue with room for them and as many more."""
        if self._next is not None:
            return
        live = min(len(self._stamp), self._tail - self._head)  # at most one current use a slot
        size = max(len(self._queue_slot), 2 * (live + room))
        self._next = (np.empty(size, dtype=np.int64), np.empty(size, dtype=np.int64))
        self._copied, self._next_tail = self._head, 0

    def _copy(self, count: int) -> None:
        """Copy up to ``count`` more old positions' current uses; switch queues when caught up."""
        new_slot, new_stamp = self._next
        end = min(self._tail, max(self._copied, self._head) + count)
        start = max(self._copied, self._head)  # (consumed meanwhile: not copied)
        slots, stamps = self._queue_slot[start:end], self._queue_stamp[start:end]
        current = self._stamp[slots] == stamps
        kept = int(np.count_nonzero(current))
        new_slot[self._next_tail:self._next_tail + kept] = slots[current]
        new_stamp[self._next_tail:self._next_tail + kept] = stamps[current]
        self._next_tail += kept
        self._copied = end
        if end == self._tail:  # caught up: the new queue takes over
            self._queue_slot, self._queue_stamp = new_slot, new_stamp
            self._head, self._tail = 0, self._next_tail
            self._next = None
