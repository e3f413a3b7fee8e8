"""The block index: (namespace, key) -> tier slot, with pins, checksums and an eviction order.

Pure bookkeeping: it never touches tensors. A store is two-phase: ``prepare_store``
reserves slots and creates pinned, invisible entries; ``complete_store`` makes the
successful ones visible with their checksum and forgets the rest. A load is
two-phase too, so that an entry is pinned (not evictable) while its bytes move.
Every prepare must be followed by its complete, also on errors.

The slot is the entry: its state, pins, checksum and owner are arrays indexed by
slot, and each namespace maps keys to slots (``KeySpace``: dicts in shards, so that no
rebuild of one stops a request for long). A batch is then a few dictionary
passes in C (``map``, ``dict.update``) and vector operations, with no Python loop
per block on the store and load paths (measured in docs/benchmarks.md,
``kvxfer bench bookkeeping``). Keys within one batch are distinct (the edge checks).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from itertools import repeat

import numpy as np

from kvxfer.fastpath import FAST
from kvxfer.index.entries import Evicted, IndexStats, Plan, Victim
from kvxfer.index.eviction import LRU, EvictionPolicy
from kvxfer.index.keyspace import KeySpace, shards_for
from kvxfer.tiers.slots import SlotAllocator, int_array, slot_array
from kvxfer.records import Outcome, TierKind

FREE, PENDING, READY, DROPPED = 0, 1, 2, 3  # slot states; DROPPED: gone from the index, still pinned
_OUTCOMES = list(Outcome)
# Outcome codes (int8 arrays of them): plain ints, since hashing an Enum member runs Python code.
_DONE, _ALREADY_PRESENT, _NOT_FOUND, _EXHAUSTED = (_OUTCOMES.index(o) for o in (
    Outcome.DONE, Outcome.ALREADY_PRESENT, Outcome.NOT_FOUND, Outcome.RESOURCE_EXHAUSTED))


class BlockIndex:
    """The index of one tier. Thread-safe."""

    def __init__(self, tier: TierKind, slots: SlotAllocator | int, policy: EvictionPolicy | None = None) -> None:
        """``slots``: the tier's free-slot bookkeeping (``Tier.slots``), or a capacity for one of its own."""
        self.tier = tier
        self._slots = slots if isinstance(slots, SlotAllocator) else SlotAllocator(slots)
        capacity = self._slots.capacity
        self._policy = policy if policy is not None else LRU(capacity)
        self._state = np.zeros(capacity, dtype=np.int8)
        self._pins = np.zeros(capacity, dtype=np.int32)
        self._checksum = np.zeros(capacity, dtype=np.uint64)
        self._owner_ns = np.zeros(capacity, dtype=np.int32)  # a key of _ns_names
        self._owner_key = np.empty(capacity, dtype=object)
        # A namespace's structures live while it holds a key: ids of emptied ones are reused, so
        # clients naming ever new namespaces cost nothing once their blocks are gone.
        self._spaces: dict[str, KeySpace] = {}  # namespace -> key -> slot
        self._shards = shards_for(capacity)  # of each namespace's key map (kvxfer.index.keyspace)
        self._ns_ids: dict[str, int] = {}
        self._ns_names: dict[int, str] = {}
        self._free_ns_ids: list[int] = []
        self._lock = threading.Lock()
        self._evictions = 0
        self._ready_count = self._pinned_count = 0  # kept as entries change: Stats reads them in O(1)

    # -- store -----------------------------------------------------------------
    def prepare_store(self, namespace: str, keys: list[bytes]) -> Plan:
        """New pinned, invisible entries with reserved slots for keys not stored yet."""
        with self._lock:
            space = self._space(namespace)
            fast = self._insert_all_new(space, keys)
            if fast is not None:  # the usual case: every key new, inserted in one pass
                (slots, evicted), new = fast, None
            elif FAST is None and space.isdisjoint(keys):  # (with FAST, a key is held already)
                new = None
                slots, evicted = self._reserve(len(keys))
            else:
                found = self._find(space, keys)
                new = np.flatnonzero(found < 0)
                # Keys of this batch that are stored already become most recent and may
                # not be evicted to make room for the batch's new keys.
                held = found[found >= 0]
                held = held[self._state[held] == READY]
                self._pin(held, 1)
                try:
                    slots, evicted = self._reserve(len(new))
                finally:
                    self._pin(held, -1)
                    self._policy.used(held)
            if len(slots) == len(keys):
                outcomes, positions, stored = [Outcome.DONE] * len(keys), range(len(keys)), keys
            else:
                new = np.arange(len(keys)) if new is None else new
                taken = new[:len(slots)]
                codes = np.full(len(keys), _ALREADY_PRESENT, dtype=np.int8)
                codes[taken] = _DONE
                codes[new[len(slots):]] = _EXHAUSTED
                outcomes, positions = _outcomes(codes), taken.tolist()
                stored = [keys[i] for i in positions]
            if fast is None:  # (eviction may have emptied and released the namespace: take it anew)
                _set_slots(self._space(namespace), stored, slots)
            one_extent = isinstance(slots, range)  # slices then, not gathers
            at = slice(slots.start, slots.stop) if one_extent else slot_array(slots)
            self._set_state(at, PENDING)
            self._pin(at, 1)  # reserved slots were free: unpinned
            self._owner_ns[at] = self._ns_ids[namespace]
            self._owner_key[at] = stored if one_extent else _objects(stored)  # (bytes are scalars to numpy)
            self._release_if_empty(namespace)  # nothing stored (the tier was full of pinned entries)
            return Plan(outcomes, slots, positions, evicted=evicted)

    def complete_store(self, slots: Sequence[int], checksums: list[int | None]) -> None:
        """Publish entries whose bytes are complete (checksum given); forget the others."""
        if len(slots) != len(checksums):
            raise ValueError("complete_store pairs each slot with one checksum")
        with self._lock:
            at = slot_array(slots)
            self._pin(at, -1)
            try:  # the usual case: every store completed
                values = int_array(checksums, np.uint64)
                complete = np.ones(len(at), dtype=bool)
            except TypeError:  # some are None: those failed
                complete = np.array([c is not None for c in checksums], dtype=bool)
                values = np.array([c if c is not None else 0 for c in checksums], dtype=np.uint64)
            pending = self._state[at] == PENDING
            published = pending & complete
            publish = at[published]
            self._checksum[publish] = values[published]
            self._set_state(publish, READY)
            self._policy.used(publish)
            if publish.size < at.size:  # failed stores (never visible) or stores deleted meanwhile
                self._drop(at[pending & ~complete])
                self._free_unpinned_dropped(at)

    # -- load ------------------------------------------------------------------
    def prepare_load(self, namespace: str, keys: list[bytes]) -> Plan:
        """The complete entries for these keys, pinned until ``complete_load``; NOT_FOUND for the rest."""
        with self._lock:
            found, hit = self._ready(namespace, keys)
            positions = np.flatnonzero(hit)
            at = found[positions]
            self._pin(at, 1)  # distinct keys, so distinct slots
            codes = np.where(hit, _DONE, _NOT_FOUND).astype(np.int8)
            return Plan(_outcomes(codes), at.tolist(), positions.tolist(), self._checksum[at].tolist())

    def complete_load(self, slots: Sequence[int], corrupt: set[int] = frozenset()) -> None:
        """Unpin loaded entries; drop ``slots[j]`` for j in ``corrupt`` so it is never served again."""
        with self._lock:
            at = slot_array(slots)
            self._pin(at, -1)
            if corrupt:
                self._drop(at[sorted(corrupt)])
            self._policy.used(at[self._state[at] == READY])  # most recently used
            self._free_unpinned_dropped(at)

    # -- rebuilding and trimming -------------------------------------------------
    def adopt(self, namespace: str, key: bytes, slot: int, checksum: int) -> bool:
        """A complete entry for a block the tier holds already (an index rebuilt at start;
        the slot is claimed already), most recent last. False if the key is there already."""
        with self._lock:
            space = self._space(namespace)
            if key in space:
                return False
            space[key] = slot
            self._set_state(slot, READY)
            self._checksum[slot] = checksum
            self._owner_ns[slot], self._owner_key[slot] = self._ns_ids[namespace], key
            self._policy.used(np.array([slot], dtype=np.int64))
            return True

    def evict(self, n: int) -> Evicted:
        """Drop up to ``n`` least recently used unpinned entries (a full device); returns them."""
        with self._lock:
            return self._take_victims(n)

    def entries(self) -> list[tuple[str, bytes, int, int]]:
        """(namespace, key, slot, checksum) of every complete unpinned entry, least recently used first."""
        return [entry for batch in self.entry_batches() for entry in batch]

    def entry_batches(self, size: int = 1 << 16) -> Iterator[list[tuple[str, bytes, int, int]]]:
        """``entries()`` ``size`` at a time (a tier of millions of entries is never one list of
        tuples); an entry that changed since the order was taken is left out."""
        with self._lock:
            order = self._policy.ordered(np.flatnonzero(self._evictable(np.arange(len(self._state)))))
        for start in range(0, len(order), size):
            with self._lock:
                at = order[start:start + size]
                at = at[self._evictable(at)]
                names = self._ns_names
                yield [(names[n], k, s, c) for n, k, s, c in zip(self._owner_ns[at].tolist(), self._owner_key[at],
                                                                 at.tolist(), self._checksum[at].tolist())]

    # -- queries ---------------------------------------------------------------
    def contains(self, namespace: str, keys: list[bytes]) -> list[bool]:
        return [t is not None for t in self.tiers_of(namespace, keys)]

    def tiers_of(self, namespace: str, keys: list[bytes]) -> list[TierKind | None]:
        """Where each key's complete entry is, None where there is none."""
        with self._lock:
            hit = self._ready(namespace, keys)[1]
            tier = self.tier
            return [tier if h else None for h in hit.tolist()]

    def locate(self, namespace: str, key: bytes) -> int | None:
        """The tier slot of a complete entry, or None (tools and tests)."""
        with self._lock:
            space = self._spaces.get(namespace)
            slot = space.get(key) if space is not None else None
            return slot if slot is not None and self._state[slot] == READY else None

    def stored_checksums(self, slots: Sequence[int]) -> list[int]:
        """The checksum recorded with each slot's entry (tools and the device check)."""
        with self._lock:
            return self._checksum[slot_array(slots)].tolist()

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the entries of these (distinct) keys; a store in flight is dropped when it
        completes; absent keys are ignored. Returns how many were removed."""
        with self._lock:
            found = self._find(self._spaces.get(namespace), keys)
            at = found[found >= 0]
            self._drop(at)
            return len(at)

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(self.tier, self._slots.capacity, self._slots.used, self._ready_count,
                              self._pinned_count, self._evictions)

    # -- internals (lock held) -------------------------------------------------
    def _set_state(self, at, state: int) -> None:
        """Set the state of slots ``at`` (distinct), keeping the count of READY ones."""
        before = np.count_nonzero(self._state[at] == READY)
        self._state[at] = state
        self._ready_count += int(np.count_nonzero(self._state[at] == READY) - before)

    def _pin(self, at, delta: int) -> None:
        """Add ``delta`` to the pins of slots ``at`` (distinct), keeping the count of pinned ones."""
        before = np.count_nonzero(self._pins[at])
        self._pins[at] += delta
        self._pinned_count += int(np.count_nonzero(self._pins[at]) - before)

    def _space(self, namespace: str) -> KeySpace:
        space = self._spaces.get(namespace)
        if space is None:
            space = self._spaces[namespace] = KeySpace(self._shards)
            ns = self._free_ns_ids.pop() if self._free_ns_ids else len(self._ns_names)
            self._ns_ids[namespace], self._ns_names[ns] = ns, namespace
        return space

    def _release_if_empty(self, namespace: str) -> None:
        """Forget a namespace that holds no key (every live entry's key is in its namespace's space)."""
        if not self._spaces.get(namespace, True):
            del self._spaces[namespace]
            ns = self._ns_ids.pop(namespace)
            del self._ns_names[ns]
            self._free_ns_ids.append(ns)

    @staticmethod
    def _find(space: KeySpace | None, keys: list[bytes]) -> np.ndarray:
        """The slot of each key in ``space``, -1 where absent."""
        if space is None:
            return np.full(len(keys), -1, dtype=np.int64)
        if FAST is not None and isinstance(keys, list):
            found = np.empty(len(keys), dtype=np.int64)
            FAST.find(space.shards, keys, found)
            return found
        return np.fromiter(map(space.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))

    def _ready(self, namespace: str, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Each key's slot (-1: none) and whether it holds a complete entry."""
        found = self._find(self._spaces.get(namespace), keys)
        hit = found >= 0
        hit[hit] = self._state[found[hit]] == READY
        return found, hit

    def _evictable(self, slots: np.ndarray) -> np.ndarray:
        return (self._state[slots] == READY) & (self._pins[slots] == 0)

    def _insert_all_new(self, space: KeySpace, keys: list[bytes]) -> tuple[Sequence[int], Evicted] | None:
        """Where no key is stored yet: slots reserved for the leading keys (all of them unless the
        tier is exhausted), those keys mapped in ``space`` to them, the others not; else None, and
        nothing changed. Each key is probed once (again, from cache, where eviction was needed)."""
        if FAST is None or not keys:
            return None
        n = len(keys)
        if self._slots.free >= n:  # room: the slots are known before the keys go in
            slots = self._slots.allocate(n)
            if _insert_new(space, keys, slots):
                return slots, Evicted(self.tier)
            self._slots.release_many(slot_array(slots))  # a key is stored already: the general path
            return None
        # Full: the keys go in first (slot -1 for now), so that nothing is evicted for a batch
        # that holds a stored key; then the victims go, and the keys get their slots.
        if not FAST.insert_new(space.shards, keys, 0, [-1] * n):
            return None
        try:
            slots, evicted = self._reserve(n)
        except BaseException:  # (an internal error) no key may stay behind with slot -1
            for key in keys:
                del space[key]
            raise
        for key in keys[len(slots):]:  # exhausted: every other slot is pinned
            del space[key]
        _set_slots(space, keys, slots)
        return slots, evicted

    def _reserve(self, n: int) -> tuple[list[int], Evicted]:
        """Up to n free slots, evicting what the policy names as needed."""
        short = n - self._slots.free
        evicted = self._take_victims(short) if short > 0 else Evicted(self.tier)
        return self._slots.allocate(min(n, self._slots.free)) or [], evicted

    def _take_victims(self, n: int) -> Evicted:
        """Remove up to n entries the policy names and free their slots (whose bytes stay until reused)."""
        at = self._policy.victims(n, self._evictable)
        self._evictions += len(at)
        keys, owners = self._owner_key[at], self._owner_ns[at]
        ids = [int(owners[0])] if owners.size and (owners == owners[0]).all() else np.unique(owners).tolist()
        names = {ns: self._ns_names[ns] for ns in ids}  # now: _forget may release these ids
        evicted = Evicted(self.tier, at, names, owners, keys, self._checksum[at])
        self._forget(at, keys)
        self._set_state(at, FREE)
        self._slots.release_many(at)
        return evicted

    def _drop(self, at: np.ndarray) -> None:
        """Make these entries invisible now; an unpinned one's slot is freed now, a pinned one's at its last unpin."""
        at = at[(self._state[at] == PENDING) | (self._state[at] == READY)]
        if not at.size:
            return
        self._forget(at)
        self._set_state(at, DROPPED)
        self._free_unpinned_dropped(at)

    def _free_unpinned_dropped(self, at: np.ndarray) -> None:
        """(``at`` distinct)"""
        done = at[(self._state[at] == DROPPED) & (self._pins[at] == 0)]
        if done.size:
            self._state[done] = FREE
            self._slots.release_many(done)

    def _forget(self, at: np.ndarray, owner_keys: np.ndarray | None = None) -> None:
        """Remove these slots' keys (``owner_keys``: theirs, if at hand) from their namespaces,
        where the key still maps to that slot."""
        if not at.size:
            return
        owners = self._owner_ns[at]
        one = bool((owners == owners[0]).all())  # the usual case: one namespace
        for ns in [int(owners[0])] if one else np.unique(owners).tolist():
            mine = at if one else at[owners == ns]
            keys = (owner_keys if one and owner_keys is not None else self._owner_key[mine]).tolist()
            name = self._ns_names[ns]
            space = self._spaces[name]
            if FAST is not None:  # one pass in C: look up, and delete where the key maps to this slot
                FAST.pop_owned(space.shards, keys, np.ascontiguousarray(mine, dtype=np.int64))
            else:
                popped = np.fromiter(map(space.pop, keys, repeat(-1)), dtype=np.int64, count=len(keys))  # in C
                other = np.flatnonzero((popped != mine) & (popped >= 0))  # a key that maps to another slot stays
                space.update(zip([keys[i] for i in other.tolist()], popped[other].tolist()))
            self._release_if_empty(name)
        self._owner_key[at] = None


def _insert_new(space: KeySpace, keys: list[bytes], slots: Sequence[int]) -> bool:
    """Map ``keys[i]`` to ``slots[i]`` in one probe a key if ``space`` holds none of the keys;
    else change nothing and return False (the C pass)."""
    one_extent = isinstance(slots, range)
    return FAST.insert_new(space.shards, keys, slots.start if one_extent else 0, None if one_extent else list(slots))


def _set_slots(space: KeySpace, keys: list[bytes], slots: Sequence[int]) -> None:
    """``space[keys[i]] = slots[i]`` for as many pairs as both hold (one C pass; no pairs built)."""
    if FAST is not None and isinstance(keys, list):
        if isinstance(slots, range):
            FAST.set_slots(space.shards, keys if len(keys) == len(slots) else keys[:len(slots)], slots.start)
        else:
            FAST.set_slots(space.shards, keys, 0, slots if isinstance(slots, list) else list(slots))
    else:
        space.update(zip(keys, slots))


def _outcomes(codes: np.ndarray) -> list[Outcome]:
    """Outcomes from their codes (one list operation when they are all alike, as usual)."""
    if codes.size and (codes == codes[0]).all():
        return [_OUTCOMES[int(codes[0])]] * len(codes)
    return list(map(_OUTCOMES.__getitem__, codes.tolist()))


def _objects(values: list) -> np.ndarray:
    """A 1-d object array of ``values`` (numpy would make a 2-d array of equal-length tuples)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


__all__ = ["BlockIndex", "Evicted", "IndexStats", "Plan", "Victim"]
