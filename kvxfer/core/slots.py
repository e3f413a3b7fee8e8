"""Free-slot bookkeeping for a tier of fixed-size slots. Touches no bytes.

Free slots are a fresh tail ``[fresh, capacity)`` never handed out, and a stack of
released ones. Taking or returning n slots costs O(n) vector work whatever the tier's
size or fragmentation (a list of extents searched first-fit cost O(extents) a piece: a
fragmented tier of millions of blocks made an offload seconds long). Released slots are
pushed in ascending order and popped from the top, so a batch that takes back the run
of slots one eviction freed gets them in order (a ``range`` when they are consecutive).
A byte per slot says whether it is free, so that a slot returned twice is caught.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvxfer.core.c_modules import FAST
from kvxfer.core.errors import Internal


class SlotAllocator:
    """Hands out slot numbers in ``[0, capacity)``; never the same slot twice."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise Internal(f"negative tier capacity {capacity}")
        self.capacity = capacity
        self._stack = np.empty(capacity, dtype=np.uint32 if capacity < 1 << 32 else np.int64)
        self._top = 0  # released slots are _stack[:_top]
        self._fresh = 0  # slots from here on were never handed out
        self._is_free = np.ones(capacity, dtype=np.bool_)

    @property
    def free(self) -> int:
        return self._top + self.capacity - self._fresh

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def allocate(self, n: int) -> Sequence[int] | None:
        """``n`` free slots (a ``range`` when they are consecutive, the usual case: no list of n
        ints is built); None (and nothing taken) if fewer are free."""
        if n > self.free:
            return None
        if n == 0:
            return []
        k = min(n, self._top)
        popped = self._stack[self._top - k:self._top][::-1].astype(np.int64)  # the lowest of a push first
        self._top -= k
        tail = range(self._fresh, self._fresh + n - k)
        self._fresh += n - k
        self._is_free[popped] = False
        self._is_free[tail.start:tail.stop] = False
        if not k:
            return tail
        low = int(popped.min())
        if int(popped.max()) - low == k - 1 and (not tail or low + k == tail.start):
            return range(low, low + n)  # k distinct slots spanning k: one run (with the tail after it)
        return popped.tolist() + list(tail)

    def claim(self, slots: list[int]) -> None:
        """Mark ``slots`` used on a fresh allocator (an index rebuilt from what a tier holds)."""
        if self.free != self.capacity:
            raise Internal("claim is for a fresh allocator")
        taken = np.unique(slot_array(slots))
        if taken.size and not (0 <= taken[0] and taken[-1] < self.capacity):
            raise Internal(f"claimed slots out of range [0, {self.capacity})")
        self._fresh = int(taken[-1]) + 1 if taken.size else 0
        self._is_free[taken] = False
        below = np.flatnonzero(self._is_free[:self._fresh])[::-1]  # popped lowest first
        self._stack[:below.size] = below
        self._top = below.size

    def release_many(self, slots: Sequence[int]) -> None:
        """Return slots (any order, each once, each handed out)."""
        if not len(slots):
            return
        ordered = np.sort(slot_array(slots))
        if ordered[0] < 0 or ordered[-1] >= self.capacity:
            raise Internal(f"slots out of range [0, {self.capacity}): {int(ordered[0])}..{int(ordered[-1])}")
        if self._is_free[ordered].any() or (ordered[1:] == ordered[:-1]).any():
            raise Internal("slots released twice (or never handed out)")
        self._is_free[ordered] = True
        self._stack[self._top:self._top + ordered.size] = ordered[::-1]  # popped from the top: lowest first
        self._top += ordered.size


def slot_array(slots: Sequence[int]) -> np.ndarray:
    """``slots`` as an int64 array; a ``range`` (one extent) without a pass over it."""
    if isinstance(slots, range):
        return np.arange(slots.start, slots.stop, slots.step, dtype=np.int64)
    return int_array(slots, np.int64)


def int_array(values: Sequence[int], dtype: type[np.integer]) -> np.ndarray:
    """``values`` as an int64 or uint64 array: a list of ints in one C pass where it is built
    (numpy's own conversion costs ~13 ns an item)."""
    if FAST is not None and isinstance(values, list):
        out = np.empty(len(values), dtype=dtype)
        if FAST.ints_into(values, out, dtype is np.int64):
            return out
    return np.asarray(values, dtype=dtype)
