"""Start-up checks that run before anything is allocated: devices first, then memory.

A daemon that cannot hold its configuration says so at once, in one line naming the
figures, instead of reserving memory until the OOM killer comes (``allow_overcommit``
starts it anyway). Listeners are bound before allocation too (``server.Daemon``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvxfer.core.errors import FailedPrecondition, ResourceExhausted
from kvxfer.memory import cuda_mem, room
from kvxfer.tiers.host import capacity_blocks
from kvxfer.tiers.registry import staged_blocks
from service.config import Config


@dataclass(frozen=True)
class MemoryNeed:
    """Host memory the configuration allocates at start-up, in bytes."""

    pools: int  # the daemon's own CPU pools (sealed memfds; GPU pools live on the device)
    host_tiers: int  # one per cache group, sized by the group's first pool
    staging: int  # each lower tier's write queue, per cache group (disk, shared filesystem, Redis)
    registered: int = 0  # the host tiers of the engine ranks expected to register (registered_ranks)

    @property
    def total(self) -> int:
        return self.pools + self.host_tiers + self.staging + self.registered

    def describe(self) -> str:
        return (f"{room.gib(self.total)} (CPU pools {room.gib(self.pools)}, host tiers {room.gib(self.host_tiers)}, "
                f"lower-tier staging {room.gib(self.staging)}, registered pools' host tiers "
                f"{room.gib(self.registered)})")


def resolve_devices(config: Config) -> Config:
    """Each pool's device made concrete (``auto`` -> cuda:0 or cpu); a GPU asked for and not usable
    here is a one-line error naming the pool, before anything is allocated."""
    pools = []
    for index, pool in enumerate(config.pools):
        try:
            pools.append(replace(pool, device=cuda_mem.resolve_device(pool.device)))
        except FailedPrecondition as exc:
            raise FailedPrecondition(f"pools[{index}].device: {str(exc).removeprefix('pool device ')}; "
                                     "set device: cpu (or --device cpu) to serve CPU pools") from None
    return replace(config, pools=tuple(pools))


def memory_need(config: Config) -> MemoryNeed:
    pools = sum(p.spec.nbytes for p in config.pools if p.device == "cpu")
    groups: dict[str, int] = {}  # a group's block bytes and host tier come from the first pool that makes it
    tiers = 0
    for p in config.pools:
        if (p.cache_group or p.id) not in groups:
            groups[p.cache_group or p.id] = p.spec.block_bytes
            tiers += capacity_blocks(p.host_capacity_mib, p.spec.block_bytes) * p.spec.block_bytes
    queued = staged_blocks(config.tiers)
    registered = config.registered_ranks * config.registered_host_capacity_mib << 20 if config.allow_register else 0
    return MemoryNeed(pools, tiers, queued * sum(groups.values()), registered)


def check(config: Config, measured: room.Room | None = None) -> Config:
    """The config with devices resolved, or FailedPrecondition/ResourceExhausted in one line."""
    config = resolve_devices(config)
    need = memory_need(config)
    measured = room.measure() if measured is None else measured
    if not config.allow_overcommit and need.total > measured.usable:
        raise ResourceExhausted(f"memory: this configuration needs {need.describe()}; {measured.describe()}; "
                                "lower spec.num_blocks, host_capacity_mib or registered_host_capacity_mib, or pass "
                                "--allow-overcommit")
    return config


__all__ = ["MemoryNeed", "check", "memory_need", "resolve_devices"]
