"""The pools one daemon serves, each with its own manager, addressed by id and epoch."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvxfer.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvxfer.manager import LookupResult, PoolManager
from kvxfer.pool import Pool, PoolDescriptor


@dataclass(frozen=True)
class PoolRef:
    """The pool a request addresses, and the epoch the client mapped."""

    pool_id: str
    epoch: int


class PoolRegistry:
    """Thread-safe map of pool id -> (pool, manager)."""

    def __init__(self) -> None:
        self._managers: dict[str, PoolManager] = {}
        self._lock = threading.Lock()

    def add(self, pool: Pool, host_capacity_blocks: int) -> PoolManager:
        pool_id = pool.descriptor.pool_id
        with self._lock:
            if pool_id in self._managers:
                raise AlreadyExists(f"pool {pool_id!r} exists")
            manager = self._managers[pool_id] = PoolManager(pool, host_capacity_blocks)
            return manager

    def get(self, ref: PoolRef) -> PoolManager:
        """The manager of a live pool whose epoch matches; FAILED_PRECONDITION otherwise."""
        if not ref.pool_id:
            raise InvalidArgument("a request must name its pool (pool.pool_id)")
        with self._lock:
            manager = self._managers.get(ref.pool_id)
        if manager is None:
            raise FailedPrecondition(f"unknown pool {ref.pool_id!r}")
        epoch = manager.pool.descriptor.epoch
        if ref.epoch != epoch:
            raise FailedPrecondition(f"stale epoch {ref.epoch} for pool {ref.pool_id!r} (now {epoch}): "
                                     "call GetPoolInfo and map the pool again")
        return manager

    def managers(self, pool_id: str = "") -> list[PoolManager]:
        """Every manager, or the named one (NOT_FOUND if absent)."""
        with self._lock:
            if not pool_id:
                return list(self._managers.values())
            manager = self._managers.get(pool_id)
        if manager is None:
            raise NotFound(f"no pool {pool_id!r}")
        return [manager]

    def descriptors(self, pool_id: str = "") -> list[PoolDescriptor]:
        return [m.pool.descriptor for m in self.managers(pool_id)]

    def lookup(self, refs: Sequence[PoolRef], namespace: str, keys: Sequence[bytes]) -> LookupResult:
        """Hits present in every listed pool (the ranks of one model): the minimum over pools."""
        if not refs:
            raise InvalidArgument("a lookup names at least one pool")
        if len({r.pool_id for r in refs}) != len(refs):
            raise InvalidArgument("a lookup names each pool once")
        results = [self.get(ref).lookup(namespace, keys) for ref in refs]
        tiers = [t if all(r.tiers[i] is not None for r in results) else None for i, t in enumerate(results[0].tiers)]
        return LookupResult(min(r.hits for r in results), tiers)

    def close(self) -> None:
        """Release every pool (owned pool files are removed)."""
        with self._lock:
            managers, self._managers = list(self._managers.values()), {}
        for manager in managers:
            manager.pool.close()
