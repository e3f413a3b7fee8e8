"""One pool's offload and restore: validation, the index, the host tier and a copy engine.

The policy lives here (what to copy, what a failure means); the index keeps the
books and the copy engine moves bytes. Every prepared entry is completed in a
``finally``, so pins are released on success, failure and bugs alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvxfer.errors import Cancelled, KvxferError
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.records import LookupResult, Outcome, TierStats, TransferResult, TransferStats
from kvxfer.transfer import CopyEngine, engine_for
from kvxfer.transfer.pipeline import CheckedCopier
from kvxfer.validate import check_keys, check_namespace, check_slots


@dataclass
class _Counters:
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class StoreStats:
    """One pool's store: its cache group's tiers, and what this pool moved."""

    tiers: list[TierStats]
    offloaded: TransferStats
    restored: TransferStats
    outcomes: dict[str, int]


class PoolManager:
    """Offload, restore, lookup and delete for one pool, over its cache group's tier."""

    def __init__(self, pool: Pool, group: CacheGroup | int, engine: CopyEngine | None = None) -> None:
        """``group``: the cache group the pool joins, or a capacity in blocks for a group of its own."""
        self.pool = pool
        layout = pool.layout
        if isinstance(group, int):
            group = CacheGroup(pool.descriptor.pool_id, layout, group, pin_memory=pool.is_cuda)
        group.check_joins(layout)
        self.group = group
        self.host = group.host
        self.index = group.index
        self.engine = engine or engine_for(pool, self.host)
        self.copier = CheckedCopier(self.engine, self.host)
        self._offloaded = _Counters()
        self._restored = _Counters()
        self._outcomes: dict[str, int] = {o.value: 0 for o in Outcome}
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return self.pool.layout.spec.num_blocks

    def check_offload(self, namespace: str, pairs: Sequence[tuple[int, bytes]]) -> tuple[list[int], list[bytes]]:
        """Validate an offload request whole; returns its slots and keys."""
        check_namespace(namespace)
        slots, keys = [p[0] for p in pairs], [bytes(p[1]) for p in pairs]
        check_slots(slots, self.num_blocks)
        check_keys(keys)
        return slots, keys

    def check_restore(self, namespace: str, pairs: Sequence[tuple[bytes, int]]) -> tuple[list[bytes], list[int]]:
        """Validate a restore request whole; returns its keys and slots."""
        check_namespace(namespace)
        keys, slots = [bytes(p[0]) for p in pairs], [p[1] for p in pairs]
        check_keys(keys)
        check_slots(slots, self.num_blocks)
        return keys, slots

    def offload(self, namespace: str, pairs: Sequence[tuple[int, bytes]],
                cancelled: Callable[[], bool] | None = None) -> TransferResult:
        """Copy each slot's block into the host tier under its key; one outcome per pair.

        ``cancelled`` (a job's lease) is asked between chunks; once it answers True
        nothing more is copied and none of the request's keys become visible.
        """
        slots, keys = self.check_offload(namespace, pairs)
        plan = self.index.prepare_store(namespace, keys)
        entries = plan.entries
        checksums: list[int | None] = [None] * len(entries)
        moved, seconds = 0, 0.0
        try:
            if entries:
                start = time.perf_counter()
                checksums = self.copier.to_host([slots[i] for i in plan.positions], [e.slot for e in entries],
                                                cancelled)
                seconds = time.perf_counter() - start
                moved = self._count(self._offloaded, len(entries), seconds)
        except Cancelled:
            for i in plan.positions:
                plan.outcomes[i] = Outcome.CANCELLED
        except KvxferError:
            for i in plan.positions:
                plan.outcomes[i] = Outcome.FAILED
        finally:
            self.index.complete_store(entries, checksums)  # None checksums: never visible
        self._tally(plan.outcomes)
        return TransferResult(plan.outcomes, moved, seconds)

    def restore(self, namespace: str, pairs: Sequence[tuple[bytes, int]],
                cancelled: Callable[[], bool] | None = None) -> TransferResult:
        """Copy each key's block into its slot and verify it there; one outcome per pair.

        Once ``cancelled`` answers True no further slot is written; blocks not
        done are reported CANCELLED.
        """
        keys, slots = self.check_restore(namespace, pairs)
        plan = self.index.prepare_load(namespace, keys)
        entries, positions = plan.entries, plan.positions
        corrupt: set[int] | frozenset[int] = set()
        moved, seconds = 0, 0.0
        try:
            if entries:
                start = time.perf_counter()
                try:
                    corrupt = self.copier.to_pool([e.slot for e in entries], [e.checksum for e in entries],
                                                  [slots[i] for i in positions], cancelled)
                    done = len(entries)
                except Cancelled as exc:
                    corrupt, done = exc.corrupt, exc.completed
                    for j in range(done, len(entries)):
                        plan.outcomes[positions[j]] = Outcome.CANCELLED
                seconds = time.perf_counter() - start
                moved = self._count(self._restored, done - len(corrupt), seconds)
        except KvxferError:
            for i in positions:
                plan.outcomes[i] = Outcome.FAILED
        finally:
            for j in corrupt:  # dropped at complete_load; the engine must not read their slots
                plan.outcomes[positions[j]] = Outcome.DATA_LOSS
            self.index.complete_load(entries, corrupt)
        self._tally(plan.outcomes)
        return TransferResult(plan.outcomes, moved, seconds)

    def lookup(self, namespace: str, keys: Sequence[bytes]) -> LookupResult:
        """Keys in prefix order: how many leading ones are present, and each one's tier."""
        check_namespace(namespace)
        keys = [bytes(k) for k in keys]
        check_keys(keys, unique=False)
        present = self.index.contains(namespace, keys)
        hits = next((i for i, p in enumerate(present) if not p), len(present))
        return LookupResult(hits, [self.index.tier if p else None for p in present])

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        check_namespace(namespace)
        keys = [bytes(k) for k in keys]
        check_keys(keys, unique=False)
        return self.index.delete(namespace, keys)

    def stats(self) -> StoreStats:
        i = self.index.stats()
        tier = TierStats(i.tier, i.capacity, i.used, i.ready, i.pinned, i.evictions, self.host.slot_bytes)
        with self._lock:
            return StoreStats([tier], TransferStats(**vars(self._offloaded)), TransferStats(**vars(self._restored)),
                              dict(self._outcomes))

    def _count(self, counters: _Counters, blocks: int, seconds: float) -> int:
        moved = blocks * self.host.slot_bytes
        with self._lock:
            counters.blocks += blocks
            counters.bytes += moved
            counters.seconds += seconds
        return moved

    def _tally(self, outcomes: list[Outcome]) -> None:
        counts = [(o.value, outcomes.count(o)) for o in Outcome]  # list.count: no enum hashing
        with self._lock:
            for name, n in counts:
                self._outcomes[name] += n
