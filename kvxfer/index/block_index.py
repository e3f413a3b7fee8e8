"""The block index: (namespace, key) -> tier slot, with pins, checksums and an eviction order.

Pure bookkeeping: it never touches tensors. A store is two-phase: ``prepare_store`` reserves slots and
creates pinned, invisible entries; ``complete_store`` makes the successful ones visible with their
checksum and forgets the rest. A load is two-phase too, so that an entry is pinned (not evictable)
while its bytes move. Every prepare must be followed by its complete, also on errors.

The slot is the entry: its state, pins and checksum are arrays indexed by slot, its key is kept by
the key table (``KeyTable``: one table for every namespace, sized once, never rebuilt) and its place
in the eviction order by the policy (linked lists of slots; hints move them: ``index.hints``). A
batch is then a few passes in C and vector operations, with no Python loop per block on the store
and load paths, and no call pauses to rebuild or compact anything (measured in docs/benchmarks.md,
``kvxfer bench bookkeeping`` and ``kvxfer bench scale``). Keys within one batch are distinct.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from kvxfer.core.errors import FailedPrecondition, Internal
from kvxfer.core.records import Outcome, TierKind
from kvxfer.core.slots import SlotAllocator, int_array, slot_array
from kvxfer.events.event_hub import TierEvents
from kvxfer.events.event_records import EngineBlocks, Reason, described, format_code
from kvxfer.index.entries import Entry, Evicted, IndexStats, Plan, Victim
from kvxfer.index.eviction import EvictionPolicy
from kvxfer.index.hintbook import DEFAULT_SHARE, IndexHints, book_for
from kvxfer.index.hinted import default_policy
from kvxfer.index.keytable import KeyTable
from kvxfer.index.refaults import Refaults
from kvxfer.index.tenancy import Tenancy, Tenant

FREE, PENDING, READY, DROPPED = 0, 1, 2, 3  # slot states; DROPPED: gone from the index, still pinned
_OUTCOMES = list(Outcome)
# Outcome codes (int8 arrays of them): plain ints, since hashing an Enum member runs Python code.
_DONE, _ALREADY_PRESENT, _NOT_FOUND, _EXHAUSTED = (_OUTCOMES.index(o) for o in (
    Outcome.DONE, Outcome.ALREADY_PRESENT, Outcome.NOT_FOUND, Outcome.RESOURCE_EXHAUSTED))


class BlockIndex:
    """The index of one tier. Thread-safe."""

    def __init__(self, tier: TierKind, slots: SlotAllocator | int, policy: EvictionPolicy | None = None,
                 events: TierEvents | None = None, tenants: Sequence[Tenant] = (),
                 hint_share: float = DEFAULT_SHARE) -> None:
        """``slots``: the tier's free-slot bookkeeping (``Tier.slots``), or a capacity for one of its own;
        ``policy``: default ``HintedLRU`` (``kvxfer.index.hinted``); ``events``: where to announce entries
        published and removed (under the lock, as they change); ``tenants``: their guaranteed shares of the tier
        (``kvxfer.index.tenancy``); ``hint_share``: per tenant, what retained and prefetched blocks may hold."""
        self.tier = tier
        self._slots = slots if isinstance(slots, SlotAllocator) else SlotAllocator(slots)
        capacity = self._slots.capacity
        self._policy = policy = policy if policy is not None else default_policy(capacity)
        self._hints = book_for(policy, capacity, hint_share, len(tenants) + 1)
        self._state = np.zeros(capacity, dtype=np.int8)
        self._pins = np.zeros(capacity, dtype=np.int32)
        self._checksum = np.zeros(capacity, dtype=np.uint64)
        self._format = np.zeros(capacity, dtype=np.uint8)  # each entry's key format code, for its events
        self._keys = KeyTable(capacity)
        self._events = events
        self._lock = threading.Lock()
        self.hints = IndexHints(self._hints, self._lock, self._ready,  # RETAIN, RELEASE, prefetch
                                lambda ns: self._tenancy.of(ns) if self._tenancy is not None else 0)
        self._evictions = 0
        self._refaults = Refaults(capacity)
        self._tenancy = Tenancy(tenants, capacity) if tenants else None
        if tenants and not self._policy.keeps_passed_over:
            raise FailedPrecondition("tenants' shares need the C use order (kvxfer/index/_use_order.c), which is not "
                                     "built here: install with a C compiler")
        self._ready_count = self._pinned_count = 0  # kept as entries change: Stats reads them in O(1)
        self._pin_runs: np.ndarray | None = None  # per slot: how many times its pins rose from 0 (if tracked)

    # -- store -----------------------------------------------------------------
    def prepare_store(self, namespace: str, keys: list[bytes]) -> Plan:
        """New pinned, invisible entries with reserved slots for keys not stored yet."""
        with self._lock:
            found = self._keys.find(namespace, keys)
            new = np.flatnonzero(found < 0)
            tenant = self._tenancy.of(namespace) if self._tenancy is not None else 0
            if len(new) == len(keys):  # the usual case: every key new
                self._refaults.stored(namespace, keys)
                slots, evicted = self._reserve(len(keys), tenant)
            else:
                # Keys of this batch that are stored already become most recent and may
                # not be evicted to make room for the batch's new keys.
                if self._refaults.remembers:  # (the new keys' list only where it is looked up)
                    self._refaults.stored(namespace, [keys[i] for i in new.tolist()])
                held = found[found >= 0]
                held = held[self._state[held] == READY]
                self._pin(held, 1)
                try:
                    slots, evicted = self._reserve(len(new), tenant)
                finally:
                    self._pin(held, -1)
                    self._policy.used(held)
            if len(slots) == len(keys):
                outcomes, positions, stored = [Outcome.DONE] * len(keys), range(len(keys)), keys
            else:
                taken = new[:len(slots)]
                codes = np.full(len(keys), _ALREADY_PRESENT, dtype=np.int8)
                codes[taken] = _DONE
                codes[new[len(slots):]] = _EXHAUSTED
                outcomes, positions = _outcomes(codes), taken.tolist()
                stored = [keys[i] for i in positions]
            at = slot_array(slots)
            if not self._keys.insert_new(namespace, stored, at):  # (absent above; eviction adds none)
                raise Internal("a key appeared in the index during its own store")
            self._set_state(at, PENDING)
            if self._tenancy is not None:
                self._tenancy.assign(at, tenant)
            self._pin(at, 1)  # reserved slots were free: unpinned
            return Plan(outcomes, slots, positions, evicted=evicted)

    def complete_store(self, slots: Sequence[int], checksums: list[int | None],
                       engine: EngineBlocks | None = None, formats: Sequence[int] | None = None) -> None:
        """Publish entries whose bytes are complete (checksum given); forget the others. ``engine``: what
        the engine said of these blocks, for the STORED event; else ``formats``: each one's key format code
        (what the tier they came from kept with them), kept with the entry for every later event."""
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
            if engine is not None:
                self._format[publish] = format_code(engine.key_format)
            else:
                self._format[publish] = np.asarray(formats, dtype=np.uint8)[published] if formats is not None else 0
            self._set_state(publish, READY)
            self._policy.used(publish)
            if self._events is not None:
                self._announce(publish, None, engine)
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
            if self._tenancy is not None:
                self._tenancy.hit(namespace, len(positions))
            self._pin(at, 1)  # distinct keys, so distinct slots
            codes = np.where(hit, _DONE, _NOT_FOUND).astype(np.int8)
            return Plan(_outcomes(codes), at.tolist(), positions.tolist(), self._checksum[at].tolist(),
                        formats=self._format[at].tolist())

    def complete_load(self, slots: Sequence[int], corrupt: set[int] = frozenset(),
                      reason: Reason = Reason.CORRUPTED) -> None:
        """Unpin loaded entries; drop ``slots[j]`` for j in ``corrupt`` so it is never served again
        (announced removed for ``reason``: a lower tier's Delete drops its entries this way too)."""
        with self._lock:
            at = slot_array(slots)
            self._pin(at, -1)
            if corrupt:
                self._drop(at[sorted(corrupt)], reason)
            read = at[self._state[at] == READY]
            self._policy.used(read)  # most recently used
            self._hints.read(read, time.monotonic())
            self._free_unpinned_dropped(at)

    # -- rebuilding and trimming -------------------------------------------------
    def adopt(self, namespace: str, key: bytes, slot: int, checksum: int, key_format: int = 0) -> bool:
        """A complete entry for a block the tier holds already (an index rebuilt at start;
        the slot is claimed already), most recent last. False if the key is there already."""
        with self._lock:
            at = np.array([slot], dtype=np.int64)
            if not self._keys.insert_new(namespace, [key], at):
                return False
            self._set_state(at, READY)
            if self._tenancy is not None:
                self._tenancy.assign(at, self._tenancy.of(namespace))
            self._checksum[slot] = checksum
            self._format[slot] = key_format
            self._policy.used(at)
            return True

    def evict(self, n: int) -> Evicted:
        """Drop up to ``n`` least recently used unpinned entries (a full device); returns them."""
        with self._lock:
            return self._take_victims(n)

    def entries(self) -> list[Entry]:
        """Every complete unpinned entry, least recently used first."""
        return [entry for batch in self.entry_batches() for entry in batch]

    def entry_batches(self, size: int = 1 << 16) -> Iterator[list[Entry]]:
        """``entries()`` ``size`` at a time (a tier of millions of entries is never one list of
        tuples); an entry that changed since the order was taken is left out."""
        with self._lock:
            order = self._policy.ordered(np.flatnonzero(self._evictable(np.arange(len(self._state)))))
        for start in range(0, len(order), size):
            with self._lock:
                at = order[start:start + size]
                at = at[self._evictable(at)]
                owners = self._keys.owner_ids(at).tolist()
                names = {ns: self._keys.name(ns) for ns in set(owners)}
                yield [Entry(names[n], k, s, c, f) for n, k, s, c, f in zip(
                    owners, self._keys.keys_of(at), at.tolist(), self._checksum[at].tolist(),
                    self._format[at].tolist())]

    def announce_all(self, reason: Reason | None = None) -> None:
        """Announce every complete entry stored (an index loaded at start), or removed for ``reason``
        (CLEARED: the tier goes away with its group, and the CLEARED event follows); 65,536 at a time."""
        if self._events is None:
            return
        with self._lock:
            held = np.flatnonzero(self._state == READY)
        for start in range(0, len(held), 1 << 16):
            with self._lock:
                at = held[start:start + (1 << 16)]
                self._announce(at[self._state[at] == READY], reason)
        if reason is Reason.CLEARED:
            self._events.cleared()

    def namespace_keys(self, namespace: str, size: int = 4096) -> Iterator[list[bytes]]:
        """The keys of the namespace's complete entries, ``size`` at a time (each batch read under the
        lock: entries that change meanwhile may be in it or not; the events tell which)."""
        with self._lock:
            held = np.flatnonzero(self._state == READY)
        for start in range(0, len(held), 1 << 16):
            with self._lock:
                at = held[start:start + (1 << 16)]
                at = at[self._state[at] == READY]
                owners = self._keys.owner_ids(at)
                ns = self._keys.find_id(namespace)
                keys = self._keys.keys_of(at[owners == ns]) if ns is not None else []
            for first in range(0, len(keys), size):
                yield keys[first:first + size]

    # -- queries ---------------------------------------------------------------
    def contains(self, namespace: str, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return self._ready(namespace, keys)[1].tolist()

    def tiers_of(self, namespace: str, keys: list[bytes]) -> list[TierKind | None]:
        """Where each key's complete entry is, None where there is none."""
        tier = self.tier
        return [tier if h else None for h in self.contains(namespace, keys)]

    def locate(self, namespace: str, key: bytes) -> int | None:
        """The tier slot of a complete entry, or None (tools and tests)."""
        with self._lock:
            found, hit = self._ready(namespace, [key])
            return int(found[0]) if hit[0] else None

    def stored_checksums(self, slots: Sequence[int]) -> list[int]:
        """The checksum recorded with each slot's entry (tools and the device check)."""
        with self._lock:
            return self._checksum[slot_array(slots)].tolist()

    def drop_slots(self, slots: Sequence[int]) -> None:
        """Make these entries invisible now (their keys free for another store); a pinned one's slot is freed
        at its last unpin (a pending store's: when it completes, unpublished)."""
        with self._lock:
            self._drop(slot_array(slots), Reason.DELETED)

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the entries of these (distinct) keys; a store in flight is dropped when it
        completes; absent keys are ignored. Returns how many were removed."""
        with self._lock:
            found = self._keys.find(namespace, keys)
            self._drop(found[found >= 0], Reason.DELETED)
            return int(np.count_nonzero(found >= 0))

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(self.tier, self._slots.capacity, self._slots.used, self._ready_count,
                              self._pinned_count, self._evictions, self._refaults.count,
                              tuple(self._tenancy.stats()) if self._tenancy is not None else ())

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
        if self._pin_runs is not None and delta > 0:
            at = np.asarray(at, dtype=np.int64)
            self._pin_runs[at[self._pins[at] == delta]] += 1  # pinned from nothing: a new run

    def track_pin_runs(self) -> None:
        """Count each slot's pin runs from now on (``pin_runs``)."""
        with self._lock:
            if self._pin_runs is None:
                self._pin_runs = np.zeros(len(self._pins), dtype=np.int64)

    def pin_runs(self, slots: Sequence[int]) -> np.ndarray:
        """The current pin run of each of these slots, which the caller holds pinned: a run lasts while
        any pin is held, and a slot's bytes are written only unpinned, so within one run they never change."""
        if self._pin_runs is None:
            raise Internal("pin runs are not tracked on this index")
        return self._pin_runs[slot_array(slots)]

    def _ready(self, namespace: str, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Each key's slot (-1: none) and whether it holds a complete entry."""
        found = self._keys.find(namespace, keys)
        hit = found >= 0
        hit[hit] = self._state[found[hit]] == READY
        return found, hit

    def _evictable(self, slots: np.ndarray) -> np.ndarray:
        return (self._state[slots] == READY) & (self._pins[slots] == 0)

    def _reserve(self, n: int, tenant: int = 0) -> tuple[list[int], Evicted]:
        """Up to n free slots, evicting what the policy names as needed (what ``tenant``'s store may take)."""
        short = n - self._slots.free
        evicted = self._take_victims(short, tenant) if short > 0 else Evicted(self.tier)
        return self._slots.allocate(min(n, self._slots.free)) or [], evicted

    def _take_victims(self, n: int, tenant: int = 0) -> Evicted:
        """Remove up to n entries the policy names and free their slots (whose bytes stay until reused)."""
        t = self._tenancy
        self._hints.before_victims()
        at = self._policy.victims(n, self._evictable) if t is None else t.take(self._policy, n, tenant, self._evictable)
        self._evictions += len(at)
        owners = self._keys.owner_ids(at)
        ids = [int(owners[0])] if owners.size and (owners == owners[0]).all() else np.unique(owners).tolist()
        names = {ns: self._keys.name(ns) for ns in ids}  # now: removing the keys may release these ids
        evicted = Evicted(self.tier, at, names, owners, self._keys.keys_of(at), self._checksum[at], self._format[at])
        self._refaults.evicted([names[ids[0]]] if len(ids) == 1 else [names[o] for o in owners.tolist()],
                               evicted.keys)
        if self._events is not None:
            self._announce(at, Reason.EVICTED)
        self._hints.gone(at, evicted=True)
        self._keys.remove(at)
        self._set_state(at, FREE)
        self._slots.release_many(at)
        return evicted

    def _drop(self, at: np.ndarray, reason: Reason | None = None) -> None:
        """Make these entries invisible now; an unpinned one's slot is freed now, a pinned one's at its last
        unpin. Complete ones are announced removed for ``reason``."""
        at = at[(self._state[at] == PENDING) | (self._state[at] == READY)]
        if not at.size:
            return
        if self._events is not None and reason is not None:
            self._announce(at[self._state[at] == READY], reason)
        self._keys.remove(at)
        self._policy.forget(at)
        self._hints.gone(at, evicted=False)
        self._set_state(at, DROPPED)
        self._free_unpinned_dropped(at)

    def _announce(self, at: np.ndarray, reason: Reason | None, engine: EngineBlocks | None = None) -> None:
        """Entries ``at`` published (reason None) or removed, one event a namespace."""
        if not at.size:
            return
        owners, keys, codes = self._keys.owner_ids(at), self._keys.keys_of(at), self._format[at]
        alike = (codes == codes[0]).all()
        runs = [(int(owners[0]), int(codes[0]))] if alike and (owners == owners[0]).all() else \
            sorted(set(zip(owners.tolist(), codes.tolist())))  # (one namespace in one key format, as usual)
        for ns, code in runs:
            mine = keys if len(runs) == 1 else [keys[i] for i in np.flatnonzero((owners == ns) & (codes == code))]
            said = engine if engine is not None else described(code)
            if reason is None:
                self._events.stored(self._keys.name(ns), mine, said)
            else:
                self._events.removed(self._keys.name(ns), mine, reason, said)

    def _free_unpinned_dropped(self, at: np.ndarray) -> None:
        """(``at`` distinct)"""
        done = at[(self._state[at] == DROPPED) & (self._pins[at] == 0)]
        if done.size:
            if self._tenancy is not None:
                self._tenancy.release(done)
            self._state[done] = FREE
            self._slots.release_many(done)


def _outcomes(codes: np.ndarray) -> list[Outcome]:
    """Outcomes from their codes (one list operation when they are all alike, as usual)."""
    if codes.size and (codes == codes[0]).all():
        return [_OUTCOMES[int(codes[0])]] * len(codes)
    return list(map(_OUTCOMES.__getitem__, codes.tolist()))


__all__ = ["BlockIndex", "Evicted", "IndexStats", "Plan", "Victim"]
