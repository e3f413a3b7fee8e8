"""(namespace, key) -> tier slot: a fixed-size hash table in numpy arrays, probed a batch at a time.

Why not a Python dict per namespace: a dict of a million keys grows by rehashing
everything (hundreds of milliseconds under the index lock: a latency spike) and
pays ~100 ns per inserted key; this table is sized once from the tier's capacity
(at most half full, so probes stay short), and a batch of 10,000 keys is a few
vector operations per probe round. Keys are bytes: their Python hash (cached in
the key object once computed), mixed with the namespace, places them; a match is
confirmed by comparing the namespace and the key itself, so a hash collision can
never hand out another key's slot.

Quadratic probing (offsets 1, 3, 6, ...: every cell of a power-of-two table, and
short probe chains, so that a batch needs few vector rounds); a removed entry leaves a tombstone, and the table is rebuilt from
its live entries when tombstones fill a quarter of it (amortised O(1) per removal).
"""

from __future__ import annotations

import numpy as np

EMPTY, GONE = 0, -1  # table cells hold slot + 1, or one of these


class KeyTable:
    """Maps (namespace id, key) to a slot in ``[0, capacity)``; each slot holds at most one key.

    ``owner_ns`` and ``owner_key`` are the index's arrays (namespace id and key of each
    keyed slot): the table reads them to confirm a match and never writes them."""

    def __init__(self, capacity: int, owner_ns: np.ndarray, owner_key: np.ndarray) -> None:
        size = 8
        while size < 2 * capacity:
            size *= 2
        self._mask = size - 1
        self._cell = np.zeros(size, dtype=np.int64)  # slot + 1, EMPTY or GONE
        self._hash = np.zeros(size, dtype=np.int64)
        self._claim = np.zeros(size, dtype=np.int64)  # scratch: which key of a batch claims a cell
        self._cell_of = np.zeros(max(capacity, 1), dtype=np.int64)  # each keyed slot's cell
        self._gone = 0
        self._owner_ns, self._owner_key = owner_ns, owner_key

    @staticmethod
    def hashes(ns: int, keys: list[bytes]) -> np.ndarray:
        """Where the keys go (computed once per batch: ``find`` and ``insert`` take them)."""
        return _hashes(ns, keys)

    def find(self, ns: int, keys: list[bytes], hashes: np.ndarray | None = None) -> np.ndarray:
        """The slot of each key, -1 where it has none."""
        n = len(keys)
        hashes = _hashes(ns, keys) if hashes is None else hashes
        found = np.full(n, -1, dtype=np.int64)
        cells = hashes & self._mask
        todo = np.arange(n)
        wanted = None  # the keys as an object array, made once there is a candidate to confirm
        step = 0
        while todo.size:
            at = cells[todo]
            cell = self._cell[at]
            candidate = (cell > 0) & (self._hash[at] == hashes[todo])
            if candidate.any():
                which, slots = todo[candidate], cell[candidate] - 1
                if wanted is None:
                    wanted = _objects(keys)
                same = (self._owner_ns[slots] == ns) & (self._owner_key[slots] == wanted[which]).astype(bool)
                found[which[same]] = slots[same]
                candidate[candidate] = same
            todo = todo[~(candidate | (cell == EMPTY))]  # a match or an empty cell ends a probe
            step += 1
            cells[todo] = (cells[todo] + step) & self._mask
        return found

    def insert(self, ns: int, keys: list[bytes], slots: np.ndarray, hashes: np.ndarray | None = None) -> None:
        """Key ``slots[i]`` by ``keys[i]``; the keys are distinct and have no slot yet."""
        self._place(_hashes(ns, keys) if hashes is None else hashes, np.asarray(slots, dtype=np.int64))

    def remove(self, slots: np.ndarray) -> None:
        """Forget the keys of these keyed slots."""
        if not len(slots):
            return
        self._cell[self._cell_of[slots]] = GONE
        self._gone += len(slots)
        if self._gone > (self._mask + 1) // 4:
            self._rebuild()

    def _place(self, hashes: np.ndarray, slots: np.ndarray) -> None:
        cells = hashes & self._mask
        todo = np.arange(len(slots))
        step = 0
        while todo.size:
            at = cells[todo]
            free = self._cell[at] <= EMPTY  # empty or a tombstone
            takers, taken = todo[free], at[free]
            self._claim[taken] = takers  # several keys may want one cell: the last write wins it
            won = self._claim[taken] == takers
            winners, cell = takers[won], taken[won]
            self._gone -= int(np.count_nonzero(self._cell[cell] == GONE))
            self._cell[cell] = slots[winners] + 1
            self._hash[cell] = hashes[winners]
            self._cell_of[slots[winners]] = cell
            left = np.ones(len(todo), dtype=bool)
            left[np.flatnonzero(free)[won]] = False
            todo = todo[left]
            step += 1
            cells[todo] = (cells[todo] + step) & self._mask

    def _rebuild(self) -> None:
        live = np.flatnonzero(self._cell > 0)
        slots, hashes = self._cell[live] - 1, self._hash[live].copy()
        self._cell[:] = EMPTY
        self._gone = 0
        self._place(hashes, slots)


def _hashes(ns: int, keys: list[bytes]) -> np.ndarray:
    return np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)) ^ np.int64(_mix(ns))


def _mix(ns: int) -> int:
    """A 64-bit signed constant for a namespace id (Fibonacci hashing of ns + 1)."""
    value = ((ns + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _objects(values: list) -> np.ndarray:
    """A 1-d object array of ``values`` (numpy would make a 2-d array of equal-length tuples)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out
