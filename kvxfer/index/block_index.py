"""The block index: (namespace, key) -> tier slot, with LRU, pins and checksums.

Pure bookkeeping: it never touches tensors. A store is two-phase: ``prepare_store``
reserves slots and creates pinned, invisible entries; ``complete_store`` makes the
successful ones visible with their checksum and forgets the rest. A load is
two-phase too, so that an entry is pinned (not evictable) while its bytes move.
Every prepare must be followed by its complete, also on errors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvxfer.index.eviction import LRU, EvictionPolicy
from kvxfer.index.slots import SlotAllocator
from kvxfer.records import Outcome, TierKind


@dataclass(eq=False, slots=True)
class Entry:
    """One stored block. Visible to lookups only while ``ready`` (complete, checksummed, not dropped)."""

    namespace: str
    key: bytes
    tier: TierKind
    slot: int
    checksum: int | None = None
    ready: bool = False
    pins: int = 0
    dropped: bool = False  # removed from the index while pinned; its slot is freed at the last unpin



@dataclass(frozen=True)
class Victim:
    """An entry evicted to make room: what a lower tier would need to keep it."""

    namespace: str
    key: bytes
    tier: TierKind
    checksum: int
    slot: int  # the tier slot it held (reused by the batch that evicted it: copy its bytes first)


@dataclass
class Plan:
    """The index's answer to a batch: one outcome per key, the entries to move, and the
    entries evicted to make room (their slots are reused by this batch).

    ``outcomes[positions[j]]`` belongs to ``entries[j]``; it reads DONE until the
    caller changes it.
    """

    outcomes: list[Outcome]
    entries: list[Entry]
    positions: list[int]
    evicted: list[Victim] = field(default_factory=list)


@dataclass(frozen=True)
class IndexStats:
    tier: TierKind
    capacity: int
    used: int
    ready: int
    pinned: int
    evictions: int


class BlockIndex:
    """The index of one tier. Thread-safe; every method is O(batch) with small constants,
    since it runs on the data path of every request."""

    def __init__(self, tier: TierKind, slots: SlotAllocator | int, policy: EvictionPolicy | None = None) -> None:
        """``slots``: the tier's free-slot bookkeeping (``Tier.slots``), or a capacity for one of its own."""
        self.tier = tier
        self._slots = slots if isinstance(slots, SlotAllocator) else SlotAllocator(slots)
        self._spaces: dict[str, dict[bytes, Entry]] = {}  # namespace -> key -> entry
        self._lru = policy if policy is not None else LRU()  # the evictable entries: ready and unpinned
        self._lock = threading.Lock()
        self._pinned = 0
        self._ready = 0
        self._evictions = 0

    # -- store -----------------------------------------------------------------
    def prepare_store(self, namespace: str, keys: list[bytes]) -> Plan:
        """New pinned, invisible entries with reserved slots for keys not stored yet."""
        with self._lock:
            space = self._spaces.setdefault(namespace, {})
            present = [space.get(k) for k in keys]
            # Keys of this batch that are stored already become most recent and may
            # not be evicted to make room for the batch's new keys.
            lru = self._lru
            kept = [e for e in present if e is not None and e in lru]
            for e in kept:
                lru.discard(e)
            evicted: list[Victim] = []
            slots = self._reserve(present.count(None), evicted)
            for e in kept:
                lru.add(e)
            self._pinned += len(slots)
            plan = Plan([Outcome.ALREADY_PRESENT] * len(keys), [], [], evicted)
            taken = iter(slots)
            tier = self.tier
            for i, (key, existing) in enumerate(zip(keys, present)):
                if existing is None:
                    slot = next(taken, None)
                    if slot is None:
                        plan.outcomes[i] = Outcome.RESOURCE_EXHAUSTED
                        continue
                    entry = space[key] = Entry(namespace, key, tier, slot, None, False, 1, False)
                    plan.outcomes[i] = Outcome.DONE
                    plan.entries.append(entry)
                    plan.positions.append(i)
            return plan

    def complete_store(self, entries: list[Entry], checksums: list[int | None]) -> None:
        """Publish entries whose bytes are complete (checksum given); forget the others."""
        with self._lock:
            free: list[int] = []
            for entry, checksum in zip(entries, checksums, strict=True):
                self._unpin(entry, free)
                if checksum is None or entry.dropped:
                    self._drop(entry, free)
                    continue
                entry.checksum = checksum
                entry.ready = True
                self._ready += 1
                if entry.pins == 0:
                    self._lru.add(entry)
            self._slots.release_many(free)

    # -- load ------------------------------------------------------------------
    def prepare_load(self, namespace: str, keys: list[bytes]) -> Plan:
        """The complete entries for these keys, pinned until ``complete_load``; NOT_FOUND for the rest."""
        with self._lock:
            space = self._spaces.get(namespace, {})
            lru = self._lru
            plan = Plan([Outcome.NOT_FOUND] * len(keys), [], [])
            for i, key in enumerate(keys):
                entry = space.get(key)
                if entry is None or not entry.ready:
                    continue
                if entry.pins == 0:
                    lru.discard(entry)
                    self._pinned += 1
                entry.pins += 1
                plan.outcomes[i] = Outcome.DONE
                plan.entries.append(entry)
                plan.positions.append(i)
            return plan

    def complete_load(self, entries: list[Entry], corrupt: set[int] = frozenset()) -> None:
        """Unpin loaded entries; drop ``entries[j]`` for j in ``corrupt`` so it is never served again."""
        with self._lock:
            free: list[int] = []
            for j, entry in enumerate(entries):
                self._unpin(entry, free)
                if j in corrupt:
                    self._drop(entry, free)
                elif not entry.dropped and entry.pins == 0:
                    self._lru.add(entry)  # most recently used
            self._slots.release_many(free)

    # -- rebuilding and trimming -------------------------------------------------
    def adopt(self, namespace: str, key: bytes, slot: int, checksum: int) -> bool:
        """A complete entry for a block the tier holds already (an index rebuilt at start;
        the slot is claimed already), most recent last. False if the key is there already."""
        with self._lock:
            space = self._spaces.setdefault(namespace, {})
            if key in space:
                return False
            entry = space[key] = Entry(namespace, key, self.tier, slot, checksum, True, 0, False)
            self._ready += 1
            self._lru.add(entry)
            return True

    def evict(self, n: int) -> list[Victim]:
        """Drop up to ``n`` least recently used unpinned entries (a full device); returns them."""
        with self._lock:
            victims: list[Victim] = []
            free: list[int] = []
            while len(victims) < n and (victim := self._lru.victim()) is not None:
                self._evictions += 1
                victims.append(Victim(victim.namespace, victim.key, victim.tier, victim.checksum, victim.slot))
                self._drop(victim, free)
            self._slots.release_many(free)
            return victims

    def entries(self) -> list[tuple[str, bytes, int, int]]:
        """(namespace, key, slot, checksum) of every complete entry, least recently used first."""
        with self._lock:
            return [(e.namespace, e.key, e.slot, e.checksum) for e in self._lru.ordered()]

    # -- queries ---------------------------------------------------------------
    def contains(self, namespace: str, keys: list[bytes]) -> list[bool]:
        return [t is not None for t in self.tiers_of(namespace, keys)]

    def tiers_of(self, namespace: str, keys: list[bytes]) -> list[TierKind | None]:
        """Where each key's complete entry is, None where there is none."""
        with self._lock:
            space = self._spaces.get(namespace, {})
            return [e.tier if (e := space.get(k)) is not None and e.ready else None for k in keys]

    def locate(self, namespace: str, key: bytes) -> int | None:
        """The tier slot of a complete entry, or None (tools and tests)."""
        with self._lock:
            entry = self._spaces.get(namespace, {}).get(key)
            return entry.slot if entry is not None and entry.ready else None

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove entries; absent keys are ignored. Returns how many were removed."""
        with self._lock:
            space = self._spaces.get(namespace, {})
            free: list[int] = []
            removed = 0
            for key in keys:
                entry = space.get(key)
                if entry is not None:  # a store in flight is dropped when it completes
                    self._drop(entry, free)
                    removed += 1
            self._slots.release_many(free)
            return removed

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(self.tier, self._slots.capacity, self._slots.used, self._ready, self._pinned,
                              self._evictions)

    # -- internals (lock held) -------------------------------------------------
    def _reserve(self, n: int, evicted: list[Victim]) -> list[int]:
        """Up to n free slots, evicting what the policy names (unpinned, complete) as needed;
        the victims are appended to ``evicted``."""
        if self._slots.free < n:
            free: list[int] = []
            while self._slots.free + len(free) < n and (victim := self._lru.victim()) is not None:
                self._evictions += 1
                evicted.append(Victim(victim.namespace, victim.key, victim.tier, victim.checksum, victim.slot))
                self._drop(victim, free)
            self._slots.release_many(free)
        return self._slots.allocate(min(n, self._slots.free)) or []

    def _unpin(self, entry: Entry, free: list[int]) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            self._pinned -= 1
            if entry.dropped:
                free.append(entry.slot)

    def _drop(self, entry: Entry, free: list[int]) -> None:
        """Make the entry invisible now; its slot goes to ``free`` now or at its last unpin."""
        if entry.dropped:
            return
        entry.dropped = True
        space = self._spaces[entry.namespace]
        if space.get(entry.key) is entry:
            del space[entry.key]
        if entry.ready:
            entry.ready = False
            self._ready -= 1
            self._lru.discard(entry)
        if entry.pins == 0:
            free.append(entry.slot)
