"""The pools one daemon serves, owned or registered, addressed by id and epoch.

Each pool has its own manager (copies) and job runner (ordering, leases), so
ranks never wait for each other; its tier and index belong to its cache group.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxfer.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvxfer.group import CacheGroup
from kvxfer.jobs import JobRunner
from kvxfer.layout import KVSpec, Layout
from kvxfer.manager import LookupResult, PoolManager
from kvxfer.pool import Medium, Pool, PoolDescriptor, PoolHandle, new_epoch

MIB = 1 << 20
_POOL_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class PoolRef:
    """The pool a request addresses, and the epoch the client mapped."""

    pool_id: str
    epoch: int


@dataclass(frozen=True)
class Limits:
    """Bounds on what clients may make the daemon hold."""

    max_pools: int = 8
    max_cache_groups: int = 8  # groups outlive their pools (the warm cache outlives the engine)
    max_queued_jobs: int = 256
    default_lease_s: float = 30.0
    max_lease_s: float = 600.0
    register_dir: str | None = None  # where registered pool files must live; None: registering is off
    registered_host_capacity_mib: int = 512  # default and maximum host tier of a registered pool


@dataclass(frozen=True)
class ServedPool:
    manager: PoolManager
    jobs: JobRunner

    @property
    def descriptor(self) -> PoolDescriptor:
        return self.manager.pool.descriptor

    @property
    def cache_group(self) -> str:
        return self.manager.group.name


class PoolRegistry:
    """Thread-safe map of pool id -> served pool."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self._pools: dict[str, ServedPool] = {}
        self._groups: dict[str, CacheGroup] = {}
        self._lock = threading.Lock()
        self._job_ids = itertools.count(1)  # job ids are unique across the daemon's pools

    def add(self, pool: Pool, host_capacity_blocks: int, cache_group: str = "") -> ServedPool:
        """Serve a mapped pool (owned, or registered) in a cache group (default: its own id).

        A new group gets a host tier of ``host_capacity_blocks``; an existing group keeps its own.
        """
        pool_id = pool.descriptor.pool_id
        name = cache_group or pool_id
        if not _POOL_ID_RE.match(name):
            raise InvalidArgument(f"cache group {name!r} must be 1-64 letters, digits, '_', '.', '-'")
        with self._lock:
            if pool_id in self._pools:
                raise AlreadyExists(f"pool {pool_id!r} exists")
            if len(self._pools) >= self.limits.max_pools:
                raise ResourceExhausted(f"the daemon serves {len(self._pools)} pools; at most {self.limits.max_pools}")
            group = self._groups.get(name)
            if group is None:
                if len(self._groups) >= self.limits.max_cache_groups:
                    raise ResourceExhausted(f"{len(self._groups)} cache groups exist; at most "
                                            f"{self.limits.max_cache_groups}")
                group = CacheGroup(name, pool.layout, host_capacity_blocks, pin_memory=pool.storage.is_cuda)
            manager = PoolManager(pool, group)  # refuses a pool whose block format differs from the group's
            self._groups[name] = group
            jobs = JobRunner(manager, self._job_ids, self.limits.max_queued_jobs, self.limits.default_lease_s,
                             self.limits.max_lease_s)
            served = self._pools[pool_id] = ServedPool(manager, jobs)
            return served

    def register(self, pool_id: str, spec: KVSpec, layout: Layout, handle: PoolHandle,
                 host_capacity_mib: int = 0, cache_group: str = "") -> ServedPool:
        """Map and serve a pool an engine allocated itself; it gets a fresh epoch."""
        if self.limits.register_dir is None:
            raise FailedPrecondition("this daemon does not accept registered pools (allow_register: false)")
        if not _POOL_ID_RE.match(pool_id):
            raise InvalidArgument(f"pool id {pool_id!r} must be 1-64 letters, digits, '_', '.', '-'")
        limit = self.limits.registered_host_capacity_mib
        if not 0 <= host_capacity_mib <= limit:
            raise InvalidArgument(f"host_capacity_mib {host_capacity_mib} out of range [1, {limit}] (0: {limit})")
        capacity = (host_capacity_mib or limit) * MIB // spec.block_bytes
        if capacity < 1:
            raise InvalidArgument(f"a host tier of {host_capacity_mib or limit} MiB holds no block of "
                                  f"{spec.block_bytes} bytes")
        if handle.medium is Medium.CUDA and not torch.cuda.is_available():
            raise FailedPrecondition("a CUDA pool was registered, but this daemon sees no CUDA device")
        if handle.medium is Medium.SHM:
            allowed = os.path.realpath(self.limits.register_dir)
            if os.path.commonpath([allowed, os.path.realpath(handle.path)]) != allowed:
                raise InvalidArgument(f"a registered pool file must lie under {self.limits.register_dir}, "
                                      f"got {handle.path!r}")
        with self._lock:
            if pool_id in self._pools:
                raise AlreadyExists(f"pool {pool_id!r} exists")
        descriptor = PoolDescriptor(pool_id, spec, layout, handle, epoch=new_epoch(), owned=False)
        pool = Pool.attach(descriptor)  # checks that the memory holds the geometry
        try:
            return self.add(pool, capacity, cache_group)
        except BaseException:
            pool.close()
            raise

    def unregister(self, ref: PoolRef, drain_timeout: float = 10.0) -> int:
        """Stop serving a registered pool: its queued jobs get ``drain_timeout`` to finish, the
        rest are cancelled (returned). New requests for it fail at once."""
        served = self.get(ref)
        if served.descriptor.owned:
            raise FailedPrecondition(f"pool {ref.pool_id!r} is owned by the daemon; only registered pools "
                                     "are unregistered")
        with self._lock:
            self._pools.pop(ref.pool_id, None)
        cancelled = served.jobs.close(drain_timeout)
        served.manager.pool.close()
        return cancelled

    def get(self, ref: PoolRef) -> ServedPool:
        """A live pool whose epoch matches; FAILED_PRECONDITION otherwise."""
        if not ref.pool_id:
            raise InvalidArgument("a request must name its pool (pool.pool_id)")
        with self._lock:
            served = self._pools.get(ref.pool_id)
        if served is None:
            raise FailedPrecondition(f"unknown pool {ref.pool_id!r}")
        epoch = served.descriptor.epoch
        if ref.epoch != epoch:
            raise FailedPrecondition(f"stale epoch {ref.epoch} for pool {ref.pool_id!r} (now {epoch}): "
                                     "call GetPoolInfo and map the pool again")
        return served

    def served(self, pool_id: str = "") -> list[ServedPool]:
        """Every pool, or the named one (NOT_FOUND if absent)."""
        with self._lock:
            if not pool_id:
                return list(self._pools.values())
            served = self._pools.get(pool_id)
        if served is None:
            raise NotFound(f"no pool {pool_id!r}")
        return [served]

    def descriptors(self, pool_id: str = "") -> list[PoolDescriptor]:
        return [s.descriptor for s in self.served(pool_id)]

    def lookup(self, refs: Sequence[PoolRef], namespace: str, keys: Sequence[bytes]) -> LookupResult:
        """Hits present in every listed pool (the ranks of one model): the minimum over pools,
        since a block is reusable only when every rank holds its shard."""
        if not refs:
            raise InvalidArgument("a lookup names at least one pool")
        if len({r.pool_id for r in refs}) != len(refs):
            raise InvalidArgument("a lookup names each pool once")
        results = [self.get(ref).manager.lookup(namespace, keys) for ref in refs]
        tiers = [t if all(r.tiers[i] is not None for r in results) else None for i, t in enumerate(results[0].tiers)]
        return LookupResult(min(r.hits for r in results), tiers)

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop every pool's jobs and release every pool (owned pool files are removed)."""
        with self._lock:
            served, self._pools = list(self._pools.values()), {}
        for s in served:
            s.jobs.close(drain_timeout)
            s.manager.pool.close()
