"""One pool as the daemon serves it: its manager (copies), its job runner (ordering, leases), who owns it."""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.core.records import PoolStats
from kvxfer.memory.pool import PoolDescriptor
from kvxfer.serving.jobs import JobRunner
from kvxfer.serving.pool_manager import PoolManager

DAEMON = "daemon"  # the owner of the daemon's own pools and their cache groups


@dataclass(frozen=True)
class ServedPool:
    manager: PoolManager
    jobs: JobRunner
    owner: str = DAEMON
    token_digest: bytes = b""  # of the registration token that may unregister it
    registrant_pid: int = 0  # the registering process, as the descriptor socket saw it (0: unknown)

    @property
    def descriptor(self) -> PoolDescriptor:
        return self.manager.pool.descriptor

    @property
    def cache_group(self) -> str:
        return self.manager.group.name

    def stats(self) -> PoolStats:
        store = self.manager.stats()
        return PoolStats(self.descriptor.pool_id, self.descriptor.epoch, self.cache_group, store.tiers,
                         store.offloaded, store.restored, store.outcomes, self.jobs.stats(), store.lookups,
                         self.descriptor.spec.block_size)
