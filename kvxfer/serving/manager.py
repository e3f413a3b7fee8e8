"""One pool's offload and restore: the index, the host tier and a copy engine.

The policy lives here (what to copy, what a failure means); the index keeps the
books and the copy engine moves bytes. Requests arrive as validated
``TransferBatch``es. Every prepared entry is completed in a ``finally``, so pins
are released on success, failure and bugs alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvxfer.errors import KvxferError
from kvxfer.memory.pool import Pool
from kvxfer.records import LookupResult, LookupStats, Outcome, TierStats, TransferResult, TransferStats
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.index.block_index import Plan
from kvxfer.serving.group import CacheGroup
from kvxfer.transfer import CopyEngine, engine_for
from kvxfer.transfer.pipeline import CheckedCopier
from kvxfer.validate import check_keys, check_namespace


#: Told of each transfer as it ends: its kind and result (bytes, seconds, outcomes).
TransferObserver = Callable[[TransferKind, TransferResult], None]


@dataclass(frozen=True)
class StoreStats:
    """One pool's store: its cache group's tiers, and what this pool moved."""

    tiers: list[TierStats]
    offloaded: TransferStats
    restored: TransferStats
    outcomes: dict[str, int]
    lookups: LookupStats


class PoolManager:
    """Offload, restore, lookup and delete for one pool, over its cache group's tier."""

    def __init__(self, pool: Pool, group: CacheGroup | int, engine: CopyEngine | None = None,
                 verify_on_device: bool = False, observer: TransferObserver | None = None) -> None:
        """``group``: the cache group the pool joins, or a capacity in blocks for a group of its own.
        ``verify_on_device``: a GPU pool verifies restored blocks where they landed (device XXH3).
        ``observer``: told of every transfer as it ends (the daemon's metrics)."""
        self.pool = pool
        layout = pool.layout
        if isinstance(group, int):
            group = CacheGroup(pool.descriptor.pool_id, layout, group, pin_device=pool.cuda_device)
        group.check_joins(layout)
        self.group = group
        self.host = group.host
        self.index = group.index
        self.engine = engine or engine_for(pool, self.host, verify_on_device)
        self.copier = CheckedCopier(self.engine, self.host)
        self._totals = {TransferKind.OFFLOAD: TransferStats(), TransferKind.RESTORE: TransferStats()}
        self._outcomes: dict[str, int] = {o.value: 0 for o in Outcome}
        self._lookups = LookupStats()
        self.observer = observer
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return self.pool.layout.spec.num_blocks

    def run(self, batch: TransferBatch, cancelled: Callable[[], bool] | None = None) -> TransferResult:
        """Carry out a validated batch; one outcome per block, in batch order.

        ``cancelled`` (a job's lease) is asked between chunks: once it answers True no
        further block is touched; an offload then publishes none of its keys, a
        restore reports the blocks not done CANCELLED.
        """
        result = _RUN[batch.kind](self, batch, cancelled)
        counts = [(o.value, result.outcomes.count(o)) for o in Outcome]  # list.count: no enum hashing
        with self._lock:
            for name, n in counts:
                self._outcomes[name] += n
        if self.observer is not None:
            self.observer(batch.kind, result)
        return result

    def offload(self, namespace: str, pairs: Sequence[tuple[int, bytes]],
                cancelled: Callable[[], bool] | None = None) -> TransferResult:
        """Copy each (block, key) into the host tier under its key (library callers; validates)."""
        return self.run(TransferBatch.offload(namespace, pairs, self.num_blocks), cancelled)

    def restore(self, namespace: str, pairs: Sequence[tuple[bytes, int]],
                cancelled: Callable[[], bool] | None = None) -> TransferResult:
        """Copy each (key, block) into the pool block and verify it (library callers; validates)."""
        return self.run(TransferBatch.restore(namespace, pairs, self.num_blocks), cancelled)

    def _offload(self, batch: TransferBatch, cancelled: Callable[[], bool] | None) -> TransferResult:
        plan = self.group.prepare_store(batch.namespace, batch.keys)
        entries = plan.entries
        checksums: list[int | None] = [None] * len(entries)
        moved, seconds = 0, 0.0
        try:
            if entries:
                start = time.perf_counter()
                done = self.copier.to_host([batch.blocks[i] for i in plan.positions], [e.slot for e in entries],
                                           cancelled, batch.ready_event)
                seconds = time.perf_counter() - start
                if done.cancelled:  # nothing of a cancelled offload becomes visible
                    for i in plan.positions:
                        plan.outcomes[i] = Outcome.CANCELLED
                else:
                    checksums = done.checksums
                    moved = self._count(TransferKind.OFFLOAD, len(entries), seconds)
                    self.group.write_through(batch.namespace, entries, checksums)
        except KvxferError:
            for i in plan.positions:
                plan.outcomes[i] = Outcome.FAILED
        finally:
            self.index.complete_store(entries, checksums)  # None checksums: never visible
        return TransferResult(plan.outcomes, moved, seconds)

    def _prepare_load(self, namespace: str, keys: list[bytes]) -> Plan:
        """Pin the host tier's blocks of the batch, then bring the others up from disk and pin them too."""
        plan = self.index.prepare_load(namespace, keys)
        missing = [i for i, o in enumerate(plan.outcomes) if o is Outcome.NOT_FOUND]
        if not missing or not self.group.lower:
            return plan
        lost = self.group.promote(namespace, [keys[i] for i in missing])  # may evict: ours are pinned
        more = self.index.prepare_load(namespace, [keys[i] for i in missing])
        for j, i in enumerate(missing):
            plan.outcomes[i] = lost.get(keys[i], more.outcomes[j])
        plan.entries += more.entries
        plan.positions += [missing[j] for j in more.positions]
        return plan

    def _restore(self, batch: TransferBatch, cancelled: Callable[[], bool] | None) -> TransferResult:
        plan = self._prepare_load(batch.namespace, batch.keys)
        entries, positions = plan.entries, plan.positions
        corrupt: set[int] = set()
        moved, seconds = 0, 0.0
        try:
            if entries:
                start = time.perf_counter()
                done = self.copier.to_pool([e.slot for e in entries], [e.checksum for e in entries],
                                           [batch.blocks[i] for i in positions], cancelled)
                corrupt = done.corrupt
                for j in range(done.completed, len(entries)):
                    plan.outcomes[positions[j]] = Outcome.CANCELLED
                seconds = time.perf_counter() - start
                moved = self._count(TransferKind.RESTORE, done.completed - len(corrupt), seconds)
        except KvxferError:
            for i in positions:
                plan.outcomes[i] = Outcome.FAILED
        finally:
            for j in corrupt:  # dropped at complete_load; the engine must not read these blocks
                plan.outcomes[positions[j]] = Outcome.DATA_LOSS
            self.index.complete_load(entries, corrupt)
        return TransferResult(plan.outcomes, moved, seconds)

    def lookup(self, namespace: str, keys: Sequence[bytes]) -> LookupResult:
        """Keys in prefix order: how many leading ones are present, and each one's tier."""
        check_namespace(namespace)
        keys = [bytes(k) for k in keys]
        check_keys(keys, unique=False)
        tiers = self.group.tiers_of(namespace, keys)
        hits = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        with self._lock:
            self._lookups = LookupStats(self._lookups.keys + len(keys), self._lookups.hits + hits)
        return LookupResult(hits, tiers)

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        check_namespace(namespace)
        keys = [bytes(k) for k in keys]
        check_keys(keys, unique=False)
        return self.group.delete(namespace, keys)

    def stats(self) -> StoreStats:
        tiers = self.group.tier_stats()
        with self._lock:
            return StoreStats(tiers, self._totals[TransferKind.OFFLOAD], self._totals[TransferKind.RESTORE],
                              dict(self._outcomes), self._lookups)

    def _count(self, kind: TransferKind, blocks: int, seconds: float) -> int:
        moved = blocks * self.host.slot_bytes
        with self._lock:
            t = self._totals[kind]
            self._totals[kind] = TransferStats(t.blocks + blocks, t.bytes + moved, t.seconds + seconds)
        return moved


#: The transfer each kind of batch runs (functions, not bound methods: no reference cycle,
#: so a released cache group's memory returns as soon as its last pool is gone).
_RUN = {TransferKind.OFFLOAD: PoolManager._offload, TransferKind.RESTORE: PoolManager._restore}
