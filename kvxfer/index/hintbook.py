"""A tier's hinted blocks: retained and prefetched ones, within each tenant's share.

A hint changes where a block stands in the eviction order (``kvxfer.index.hinted``); this book
keeps what bounds it. Retained blocks and prefetched blocks not read yet count against their
tenant's hint share of the tier (``share`` x capacity, per tenant): a flood of RETAIN or PREFETCH
hints from one tenant holds at most that much, and another tenant's guaranteed share is never
taken (retained blocks are still evicted, last, for a store that finds nothing else). A retain
beyond the share first clears retentions whose TTL passed, then retains what fits, the request's
first keys first (a prefix is worth most). A prefetched block evicted before anyone read it is
wasted prefetch (``wasted``: the metric operators alert on). Used under the index's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvxfer.core.records import HintAction
from kvxfer.index.eviction import EvictionPolicy
from kvxfer.index.hinted import HintedLRU

DEFAULT_SHARE = 0.5  # of a tier, per tenant: retained plus prefetched-unread blocks


@dataclass(frozen=True)
class HintStats:
    """A tier's hinted blocks now, and its counters."""

    retained: int = 0  # blocks whose retention holds now
    released: int = 0  # blocks at the eviction front (released, unread since)
    prefetched: int = 0  # prefetched blocks not read yet
    wasted: int = 0  # prefetched blocks evicted before anyone read them
    evicted: dict[str, int] = field(default_factory=dict)  # evictions by EvictionReason value


class NoHints:
    """The book of an index without ``HintedLRU`` (the C use order is not built): hints change nothing."""

    def read(self, slots: np.ndarray, now: float) -> None:
        pass

    def gone(self, slots: np.ndarray, evicted: bool) -> None:
        pass

    def before_victims(self) -> None:
        pass


def book_for(policy: EvictionPolicy, capacity: int, share: float, tenants: int) -> HintBook | NoHints:
    return HintBook(policy, capacity, share, tenants) if isinstance(policy, HintedLRU) else NoHints()


class HintBook:
    """Which slots count against their tenant's hint share, and which were prefetched and not read."""

    def __init__(self, policy: HintedLRU, capacity: int, share: float, tenants: int) -> None:
        self.policy = policy
        self.limit = int(share * capacity)
        self._counted = np.zeros(capacity, dtype=bool)
        self._owner = np.zeros(capacity, dtype=np.uint8)  # the tenant a counted slot counts against
        self._prefetched = np.zeros(capacity, dtype=bool)
        self._count = np.zeros(max(1, tenants), dtype=np.int64)
        self._total = 0  # counted slots (every prefetched one is): none, and a read or an eviction costs nothing here
        self.wasted = 0

    def room(self, tenant: int, now: float, want: int = 1) -> int:
        """How many more blocks ``tenant`` may have retained or prefetched now (up to ``want``)."""
        if self._count[tenant] + want > self.limit:
            self._uncount(self.policy.expire(now))  # retentions that passed give their room back
        return int(max(0, min(want, self.limit - self._count[tenant])))

    def retain(self, slots: np.ndarray, tenant: int, until: float, now: float) -> int:
        """Retain these complete slots of ``tenant`` until ``until``, as many as its share allows; how many."""
        counted = self._counted[slots]
        new = slots[~counted]
        new = new[:self.room(tenant, now, len(new))]
        chosen = np.concatenate([slots[counted], new]) if new.size else slots[counted]
        self._count_as(new, tenant)
        self.policy.retain(chosen, until)
        return len(chosen)

    def release(self, slots: np.ndarray) -> None:
        """These complete slots go first: neither retained nor counted as prefetched (someone said they are
        done with them)."""
        self.policy.release(slots)
        self._prefetched[slots] = False
        self._uncount(slots)

    def prefetched(self, slots: np.ndarray, tenant: int) -> None:
        """These slots were just filled by a prefetch (its room asked of ``room`` first)."""
        self._prefetched[slots] = True
        self._count_as(slots[~self._counted[slots]], tenant)

    def read(self, slots: np.ndarray, now: float) -> None:
        """These slots were read: a prefetch of them paid off, and they no longer count unless retained."""
        if not self._total:
            return
        was = slots[self._prefetched[slots]]
        if was.size:
            self._prefetched[was] = False
            self._uncount(was[~self.policy.retained(was, now)])

    def before_victims(self) -> None:
        self.policy.now = time.monotonic()  # one clock read a batch: which retentions hold

    def gone(self, slots: np.ndarray, evicted: bool) -> None:
        """These slots hold no entry any more (``evicted``: to make room; a prefetched one was wasted)."""
        if not self._total:
            return
        if evicted:
            self.wasted += int(np.count_nonzero(self._prefetched[slots]))
        self._prefetched[slots] = False
        self._uncount(slots)

    def stats(self, now: float) -> HintStats:
        p = self.policy
        return HintStats(p.retained_now(now), p.released_count, int(np.count_nonzero(self._prefetched)), self.wasted,
                         {reason.value: n for reason, n in p.evicted.items()})

    def _count_as(self, slots: np.ndarray, tenant: int) -> None:
        self._counted[slots] = True
        self._owner[slots] = tenant
        self._count[tenant] += len(slots)
        self._total += len(slots)

    def _uncount(self, slots: np.ndarray) -> None:
        slots = slots[self._counted[slots] & ~self._prefetched[slots]]
        if slots.size:
            self._counted[slots] = False
            self._count -= np.bincount(self._owner[slots], minlength=len(self._count))[:len(self._count)]
            self._total -= len(slots)


class IndexHints:
    """An index's hint calls (``BlockIndex.hints``), each under the index's lock on its complete entries. Without a
    book (no ``HintedLRU``: the C use order is not built) hints change nothing."""

    def __init__(self, book: HintBook | NoHints, lock: threading.Lock,
                 ready: Callable[[str, list[bytes]], tuple[np.ndarray, np.ndarray]],
                 tenant: Callable[[str], int]) -> None:
        self._book, self._lock, self._ready, self._tenant = book, lock, ready, tenant

    def hint(self, namespace: str, keys: list[bytes], action: HintAction, until: float = 0.0) -> int:
        """RETAIN (until ``until``, on ``time.monotonic()``) or RELEASE the complete entries of these keys; how
        many it changed (absent keys, and retentions past the tenant's share, change nothing)."""
        if not isinstance(self._book, HintBook) or action not in (HintAction.RETAIN, HintAction.RELEASE):
            return 0
        with self._lock:
            found, hit = self._ready(namespace, keys)
            if action is HintAction.RELEASE:
                self._book.release(found[hit])
                return int(np.count_nonzero(hit))
            return self._book.retain(found[hit], self._tenant(namespace), until, time.monotonic())

    def room(self, namespace: str, want: int) -> int:
        """How many blocks (up to ``want``) a prefetch for this namespace may bring up within its tenant's share."""
        if not isinstance(self._book, HintBook):
            return 0
        with self._lock:
            return self._book.room(self._tenant(namespace), time.monotonic(), want)

    def mark_prefetched(self, namespace: str, keys: list[bytes]) -> int:
        """The complete entries of these keys were brought up by a prefetch; how many."""
        if not isinstance(self._book, HintBook):
            return 0
        with self._lock:
            found, hit = self._ready(namespace, keys)
            self._book.prefetched(found[hit], self._tenant(namespace))
            return int(np.count_nonzero(hit))

    def stats(self) -> HintStats:
        if not isinstance(self._book, HintBook):
            return HintStats()
        with self._lock:
            return self._book.stats(time.monotonic())


__all__ = ["DEFAULT_SHARE", "HintBook", "HintStats", "IndexHints"]
