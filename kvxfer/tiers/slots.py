"""Free-slot bookkeeping for a tier of fixed-size slots. Touches no bytes.

Free slots are kept as sorted, non-touching extents ``[start, start + length)``.
A batch gets one contiguous extent when one is large enough, so that a gather can
write straight into its destination; otherwise the largest extents first, to
keep the number of pieces small.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from kvxfer.errors import Internal
from kvxfer.fastpath import FAST


class SlotAllocator:
    """Hands out slot numbers in ``[0, capacity)``; never the same slot twice."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise Internal(f"negative tier capacity {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []
        self._lengths: list[int] = [capacity] if capacity else []
        self._free = capacity

    @property
    def free(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.capacity - self._free

    def allocate(self, n: int) -> Sequence[int] | None:
        """``n`` free slots, ascending within each extent (a ``range`` when one extent holds them,
        the usual case: no list of n ints is built); None (and nothing taken) if fewer are free."""
        if n > self._free:
            return None
        if n == 0:
            return []
        for i, length in enumerate(self._lengths):  # first fit: one contiguous extent
            if length >= n:
                return self._take(i, n)
        slots: list[int] = []
        while len(slots) < n:  # fragmented: largest extents first
            i = max(range(len(self._lengths)), key=self._lengths.__getitem__)
            slots += self._take(i, min(self._lengths[i], n - len(slots)))
        return slots

    def claim(self, slots: list[int]) -> None:
        """Mark ``slots`` used on a fresh allocator (an index rebuilt from what a tier holds)."""
        if self._free != self.capacity:
            raise Internal("claim is for a fresh allocator")
        taken = sorted(set(slots))
        if taken and not (0 <= taken[0] and taken[-1] < self.capacity):
            raise Internal(f"claimed slots out of range [0, {self.capacity})")
        self._starts, self._lengths, start = [], [], 0
        for slot in [*taken, self.capacity]:
            if slot > start:
                self._starts.append(start)
                self._lengths.append(slot - start)
            start = slot + 1
        self._free = self.capacity - len(taken)

    def _take(self, i: int, n: int) -> range:
        start = self._starts[i]
        if self._lengths[i] == n:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i] += n
            self._lengths[i] -= n
        self._free -= n
        return range(start, start + n)

    def release_many(self, slots: Sequence[int]) -> None:
        """Return several slots; consecutive ones are merged first (in numpy), so this costs
        Python work per extent, not per slot."""
        if not len(slots):
            return
        ordered = np.sort(slot_array(slots))
        breaks = np.flatnonzero(np.diff(ordered) != 1)  # where an extent ends (not the last)
        starts = ordered[np.concatenate(([0], breaks + 1))].tolist()
        lasts = ordered[np.concatenate((breaks, [len(ordered) - 1]))].tolist()
        for start, last in zip(starts, lasts):
            self._release_extent(start, last - start + 1)

    def _release_extent(self, slot: int, n: int) -> None:
        """Return [slot, slot + n); merges with neighbouring free extents."""
        if not (0 <= slot and slot + n <= self.capacity):
            raise Internal(f"slots [{slot}, {slot + n}) out of range [0, {self.capacity})")
        i = bisect.bisect_right(self._starts, slot)
        if (i > 0 and self._starts[i - 1] + self._lengths[i - 1] > slot) or \
                (i < len(self._starts) and self._starts[i] < slot + n):
            raise Internal(f"slots [{slot}, {slot + n}) released twice")
        joins_left = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == slot
        joins_right = i < len(self._starts) and self._starts[i] == slot + n
        if joins_left and joins_right:
            self._lengths[i - 1] += n + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif joins_left:
            self._lengths[i - 1] += n
        elif joins_right:
            self._starts[i] = slot
            self._lengths[i] += n
        else:
            self._starts.insert(i, slot)
            self._lengths.insert(i, n)
        self._free += n


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
