"""The keys of one tier: (namespace, key) -> slot, with each key's bytes kept by its slot.

A slot holds at most one key, so a key is removed by naming its slot, and the keys of the
entries an eviction takes are read from their slots. In C (``kvxfer/index/_tables.c``: one table
sized once for the tier, never rebuilt, about 55 bytes a block) where it is built; else
``PyKeys``, dicts with the same answers. Namespaces get small ids while they hold a key; the
id of an emptied one is reused, so clients naming ever new namespaces cost nothing once
their blocks are gone.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvxfer.core.c_modules import load

TABLES = load("kvxfer.index._tables")  # the key table in C (_tables.c), or None
MAX_NATIVE_SLOTS = 1 << 31  # the C table's limit (slot + 1 in 32 bits)


class PyKeys:
    """The C table's twin: a dict of keys per namespace id, and each slot's key and owner."""

    def __init__(self, capacity: int) -> None:
        self._maps: dict[int, dict[bytes, int]] = {}
        self._keys = np.empty(capacity, dtype=object)
        self._owners = np.full(capacity, -1, dtype=np.int32)

    def find(self, ns: int, keys: list[bytes], out: np.ndarray) -> None:
        held = self._maps.get(ns, {})
        out[:] = np.fromiter(map(held.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))

    def insert_new(self, ns: int, keys: list[bytes], slots: np.ndarray) -> bool:
        held = self._maps.setdefault(ns, {})
        if len(set(keys)) != len(keys) or not held.keys().isdisjoint(keys):
            return False
        if (self._owners[slots] >= 0).any():  # (slots are distinct: the allocator's)
            raise ValueError("a slot is out of range or holds a key")
        held.update(zip(keys, slots.tolist()))
        self._keys[slots] = _objects(keys)
        self._owners[slots] = ns
        return True

    def remove(self, slots: np.ndarray) -> int:
        mine = slots[self._owners[slots] >= 0]
        owners = self._owners[mine]
        for ns in np.unique(owners).tolist():
            held = self._maps[ns]
            deque(map(held.__delitem__, self._keys[mine[owners == ns]].tolist()), maxlen=0)  # (a pass in C)
            if not held:
                del self._maps[ns]
        self._owners[mine] = -1
        self._keys[mine] = None
        return len(mine)

    def keys_of(self, slots: np.ndarray) -> list[bytes | None]:
        return self._keys[slots].tolist()

    def owners(self, slots: np.ndarray, out: np.ndarray) -> None:
        out[:] = self._owners[slots]

    def __len__(self) -> int:
        return sum(map(len, self._maps.values()))


class KeyTable:
    """Every namespace's keys in one tier. Not thread-safe: the index holds its lock."""

    def __init__(self, capacity: int) -> None:
        native = TABLES is not None and capacity <= MAX_NATIVE_SLOTS
        self._table = TABLES.KeyTable(capacity) if native else PyKeys(capacity)
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free_ids: list[int] = []
        self._counts: Counter[int] = Counter()  # keys held, by namespace id

    def find(self, namespace: str, keys: list[bytes]) -> np.ndarray:
        """The slot of each key (int64), -1 where it has none."""
        out = np.full(len(keys), -1, dtype=np.int64)
        ns = self._ids.get(namespace)
        if ns is not None and keys:
            self._table.find(ns, keys, out)
        return out

    def insert_new(self, namespace: str, keys: list[bytes], slots: Sequence[int] | np.ndarray) -> bool:
        """``keys[i]`` -> ``slots[i]`` (free slots) if the namespace holds none of the keys; else
        False and nothing changed."""
        if not keys:
            return True
        ns = self._id(namespace)
        done = self._table.insert_new(ns, keys, np.ascontiguousarray(slots, dtype=np.int64))
        if done:
            self._counts[ns] += len(keys)
        self._release_if_empty(ns)
        return done

    def remove(self, slots: np.ndarray) -> None:
        """Forget the keys these (distinct) slots hold; a slot without one is left alone."""
        if not len(slots):
            return
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        owners = self.owner_ids(slots)
        self._table.remove(slots)
        ids, counts = np.unique(owners[owners >= 0], return_counts=True)
        for ns, count in zip(ids.tolist(), counts.tolist()):
            self._counts[ns] -= count
            self._release_if_empty(ns)

    def keys_of(self, slots: np.ndarray) -> list[bytes | None]:
        """The key each slot holds (None: none)."""
        return self._table.keys_of(np.ascontiguousarray(slots, dtype=np.int64))

    def owner_ids(self, slots: np.ndarray) -> np.ndarray:
        """The namespace id of each slot's key (int32), -1 for none; ``name`` tells an id's name."""
        out = np.empty(len(slots), dtype=np.int32)
        self._table.owners(np.ascontiguousarray(slots, dtype=np.int64), out)
        return out

    def name(self, ns: int) -> str:
        return self._names[ns]

    def find_id(self, namespace: str) -> int | None:
        """The namespace's id while it holds a key."""
        return self._ids.get(namespace)

    def __len__(self) -> int:
        return len(self._table)

    def _id(self, namespace: str) -> int:
        ns = self._ids.get(namespace)
        if ns is None:
            ns = self._free_ids.pop() if self._free_ids else len(self._names)
            self._ids[namespace], self._names[ns] = ns, namespace
        return ns

    def _release_if_empty(self, ns: int) -> None:
        if not self._counts[ns]:
            del self._counts[ns]
            self._free_ids.append(ns)
            del self._ids[self._names.pop(ns)]


def _objects(values: list) -> np.ndarray:
    """A 1-d object array of ``values`` (numpy would make a 2-d array of equal-length tuples)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


__all__ = ["KeyTable", "PyKeys"]
