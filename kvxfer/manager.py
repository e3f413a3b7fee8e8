"""One pool's offload and restore: validation, the index, the host tier and a copy engine.

The policy lives here (what to copy, what a failure means); the index keeps the
books and the copy engine moves bytes. Every prepared entry is completed in a
``finally``, so pins are released on success, failure and bugs alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvxfer.errors import KvxferError
from kvxfer.pool import Pool
from kvxfer.store import BlockIndex, IndexStats, Outcome, TierKind
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import CopyEngine, engine_for
from kvxfer.transfer.checked import CheckedCopier
from kvxfer.validate import check_keys, check_namespace, check_slots


@dataclass
class TransferCounters:
    """Measured totals: bytes and blocks moved and the seconds the moves took."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class PoolStats:
    index: IndexStats
    slot_bytes: int
    offloaded: TransferCounters = field(default_factory=TransferCounters)
    restored: TransferCounters = field(default_factory=TransferCounters)
    outcomes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TransferResult:
    """One request's outcomes (in request order) and what it measurably moved."""

    outcomes: list[Outcome]
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class LookupResult:
    hits: int  # how many leading keys are present
    tiers: list[TierKind | None]  # where each key is, None if absent


class PoolManager:
    """Offload, restore, lookup and delete for one pool."""

    def __init__(self, pool: Pool, host_capacity_blocks: int, engine: CopyEngine | None = None) -> None:
        self.pool = pool
        layout = pool.layout
        storage = pool.storage
        self.host = HostTier(host_capacity_blocks, layout.block_bytes, pin_memory=storage.is_cuda)
        self.index = BlockIndex(TierKind.HOST, host_capacity_blocks)
        self.engine = engine or engine_for(pool.descriptor.handle.medium, storage, layout, self.host)
        self.copier = CheckedCopier(self.engine, self.host)
        self._offloaded = TransferCounters()
        self._restored = TransferCounters()
        self._outcomes: dict[str, int] = {o.value: 0 for o in Outcome}
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return self.pool.layout.spec.num_blocks

    def offload(self, namespace: str, pairs: Sequence[tuple[int, bytes]]) -> TransferResult:
        """Copy each slot's block into the host tier under its key; one outcome per pair."""
        check_namespace(namespace)
        slots, keys = [p[0] for p in pairs], [bytes(p[1]) for p in pairs]
        check_slots(slots, self.num_blocks)
        check_keys(keys)
        plan = self.index.prepare_store(namespace, keys)
        entries = plan.entries
        checksums: list[int | None] = [None] * len(entries)
        moved, seconds = 0, 0.0
        try:
            if entries:
                start = time.perf_counter()
                checksums = self.copier.to_host([slots[i] for i in plan.positions], [e.slot for e in entries])
                seconds = time.perf_counter() - start
                moved = self._count(self._offloaded, len(entries), seconds)
        except KvxferError:
            for i in plan.positions:
                plan.outcomes[i] = Outcome.FAILED
        finally:
            self.index.complete_store(entries, checksums)  # None checksums: never visible
        self._tally(plan.outcomes)
        return TransferResult(plan.outcomes, moved, seconds)

    def restore(self, namespace: str, pairs: Sequence[tuple[bytes, int]]) -> TransferResult:
        """Copy each key's block into its slot and verify it there; one outcome per pair."""
        check_namespace(namespace)
        keys, slots = [bytes(p[0]) for p in pairs], [p[1] for p in pairs]
        check_keys(keys)
        check_slots(slots, self.num_blocks)
        plan = self.index.prepare_load(namespace, keys)
        entries, positions = plan.entries, plan.positions
        corrupt: set[int] = set()
        moved, seconds = 0, 0.0
        try:
            if entries:
                start = time.perf_counter()
                try:
                    corrupt = self.copier.to_pool([e.slot for e in entries], [e.checksum for e in entries],
                                                  [slots[i] for i in positions])
                    seconds = time.perf_counter() - start
                    moved = self._count(self._restored, len(entries) - len(corrupt), seconds)
                except KvxferError:
                    for i in positions:
                        plan.outcomes[i] = Outcome.FAILED
                for j in corrupt:  # dropped at complete_load; the engine must not read their slots
                    plan.outcomes[positions[j]] = Outcome.DATA_LOSS
        finally:
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

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self.index.stats(), self.host.slot_bytes, TransferCounters(**vars(self._offloaded)),
                             TransferCounters(**vars(self._restored)), dict(self._outcomes))

    def _count(self, counters: TransferCounters, blocks: int, seconds: float) -> int:
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
