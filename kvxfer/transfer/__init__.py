"""Copy engines, chosen by (source medium, destination medium)."""

from __future__ import annotations

from collections.abc import Callable

from kvxfer.core.errors import FailedPrecondition
from kvxfer.core.records import Medium, TierKind
from kvxfer.geometry.layout import PoolLayout
from kvxfer.memory import cuda_driver
from kvxfer.memory.pool import Access, Pool
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CompletedHandle, CopyBatch, CopyEngine, CopyHandle, Direction
from kvxfer.transfer.cpu import CpuCopyEngine
from kvxfer.transfer.cuda import CudaCopyEngine
from kvxfer.transfer.fdcopy import FdCopyEngine
from kvxfer.transfer.shard import ShardCopyEngine


def _mapped(pool: Pool, host: HostTier, checksum_on_device: bool, threads: int, deadline_s: float) -> CopyEngine:
    return CpuCopyEngine(pool.storage, pool.layout, host, threads)


def _guarded(pool: Pool, host: HostTier, checksum_on_device: bool, threads: int, deadline_s: float) -> CopyEngine:
    return CpuCopyEngine(pool.storage, pool.layout, host, threads, mapping=pool.mapping())


def _through_fd(pool: Pool, host: HostTier, checksum_on_device: bool, threads: int, deadline_s: float) -> CopyEngine:
    return FdCopyEngine(pool.fd, pool.descriptor.handle.offset, pool.layout, host)


def _cuda(pool: Pool, host: HostTier, checksum_on_device: bool, threads: int, deadline_s: float) -> CopyEngine:
    return CudaCopyEngine(pool.storage.data_ptr(), pool.layout, host, cuda_driver.driver(pool.cuda_device),
                          deadline_s=deadline_s, pool=pool.storage, hash_threads=threads,
                          device_checksums=checksum_on_device)


#: (pool medium, how this process reaches it, tier) -> engine factory.
ENGINES: dict[tuple[Medium, Access, TierKind], Callable[[Pool, HostTier, bool, int, float], CopyEngine]] = {
    (Medium.SHM, Access.MAPPED, TierKind.HOST): _mapped,
    (Medium.MEMFD, Access.MAPPED, TierKind.HOST): _mapped,
    (Medium.SHM, Access.GUARDED, TierKind.HOST): _guarded,
    (Medium.MEMFD, Access.GUARDED, TierKind.HOST): _guarded,
    (Medium.SHM, Access.FILE, TierKind.HOST): _through_fd,
    (Medium.MEMFD, Access.FILE, TierKind.HOST): _through_fd,
    (Medium.CUDA, Access.MAPPED, TierKind.HOST): _cuda,
}


def _shard_mapped(pool: Pool, host: HostTier, canonical: PoolLayout, threads: int, deadline_s: float) -> CopyEngine:
    return ShardCopyEngine(pool.storage, pool.layout, pool.descriptor.sharding.heads, host, canonical, threads)


def _shard_cuda(pool: Pool, host: HostTier, canonical: PoolLayout, threads: int, deadline_s: float) -> CopyEngine:
    return CudaCopyEngine(pool.storage.data_ptr(), pool.layout, host, cuda_driver.driver(pool.cuda_device),
                          deadline_s=deadline_s, pool=pool.storage, hash_threads=threads,
                          shard=(canonical, pool.descriptor.sharding.heads[0]))


#: (pool medium, how this process reaches it) -> the engine moving a tensor-parallel rank's pieces of
#: canonical blocks.
SHARD_ENGINES: dict[tuple[Medium, Access], Callable[[Pool, HostTier, PoolLayout, int, float], CopyEngine]] = {
    (Medium.SHM, Access.MAPPED): _shard_mapped,
    (Medium.MEMFD, Access.MAPPED): _shard_mapped,
    (Medium.CUDA, Access.MAPPED): _shard_cuda,
}


def engine_for(pool: Pool, host: HostTier, checksum_on_device: bool = True, threads: int = 2,
               deadline_s: float = 30.0, canonical: PoolLayout | None = None) -> CopyEngine:
    """The engine for a pool and tier; ``checksum_on_device``: GPU pools hash blocks on the device;
    ``threads``: a CPU engine's copy threads; a GPU engine's threads hashing tier copies;
    ``deadline_s``: how long a GPU copy may take; ``canonical``: the tier holds canonical blocks of
    which the pool (a tensor-parallel rank's) holds its heads' slices."""
    medium = pool.descriptor.handle.medium
    if canonical is not None:
        try:
            make_shard = SHARD_ENGINES[(medium, pool.access)]
        except KeyError:
            raise FailedPrecondition(f"a tensor-parallel rank's {medium.value} pool ({pool.access.value} access) "
                                     "cannot be served in a group of canonical blocks: hand over a sealed memfd "
                                     "(the daemon maps it), or register it without sharding") from None
        return make_shard(pool, host, canonical, threads, deadline_s)
    try:
        make = ENGINES[(medium, pool.access, TierKind.HOST)]
    except KeyError:
        raise FailedPrecondition(f"no copy engine between a {medium.value} pool and the host tier") from None
    return make(pool, host, checksum_on_device, threads, deadline_s)


__all__ = ["CompletedHandle", "CopyBatch", "CopyEngine", "CopyHandle", "Direction", "engine_for", "ENGINES", "FdCopyEngine"]
