"""Start-up checks that run before anything is allocated: devices first, then memory; and what
``serve --check`` asks the servers lower tiers need (``reachable``).

A daemon that cannot hold its configuration says so at once, in one line naming the
figures, instead of reserving memory until the OOM killer comes (``allow_overcommit``
starts it anyway). Listeners are bound before allocation too (``server.Daemon``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvxfer.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from kvxfer.memory import cuda_mem, room
from kvxfer.tiers.host import capacity_blocks
from kvxfer.tiers.registry import client_bytes, staged_blocks, unanswered
from service.config import Config


@dataclass(frozen=True)
class MemoryNeed:
    """Host memory the configuration allocates at start-up, in bytes."""

    pools: int  # the daemon's own CPU pools (sealed memfds; GPU pools live on the device)
    host_tiers: int  # one per cache group, sized by the group's first pool
    staging: int  # each lower tier's write queue, per cache group (disk, shared filesystem, Redis)
    registered: int = 0  # the host tiers of the engine ranks expected to register (registered_ranks)
    clients: int = 0  # each cache group's lower-tier clients (a Mooncake segment and transfer buffer), all groups

    @property
    def total(self) -> int:
        return self.pools + self.host_tiers + self.staging + self.registered + self.clients

    def describe(self) -> str:
        return (f"{room.gib(self.total)} (CPU pools {room.gib(self.pools)}, host tiers {room.gib(self.host_tiers)}, "
                f"lower-tier staging {room.gib(self.staging)}, registered pools' host tiers "
                f"{room.gib(self.registered)}, lower-tier clients {room.gib(self.clients)})")


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
    ranks = config.registered_ranks if config.allow_register else 0  # (each registered rank: a group of its own)
    registered = ranks * config.registered_host_capacity_mib << 20
    return MemoryNeed(pools, tiers, queued * sum(groups.values()), registered,
                      (len(groups) + ranks) * client_bytes(config.tiers))


def check(config: Config, measured: room.Room | None = None) -> Config:
    """The config with devices resolved, or FailedPrecondition/ResourceExhausted in one line."""
    config = resolve_devices(config)
    need = memory_need(config)
    measured = room.measure() if measured is None else measured
    if not config.allow_overcommit and need.total > measured.usable:
        raise ResourceExhausted(f"memory: this configuration needs {need.describe()}; {measured.describe()}; "
                                f"lower spec.num_blocks, host_capacity_mib, registered_host_capacity_mib"
                                f"{', mooncake.segment_mib or buffer_mib' if need.clients else ''}, or pass "
                                "--allow-overcommit")
    return config


def reachable(config: Config) -> None:
    """``serve --check``'s question to the servers the lower tiers need: Unavailable, one line naming the setting,
    if one would not answer a start now (the daemon would then serve with that tier degraded)."""
    lines = unanswered(config.tiers)
    if lines:
        raise Unavailable(f"{lines[0]}: a start would serve with this tier degraded until it answers")


__all__ = ["MemoryNeed", "check", "memory_need", "reachable", "resolve_devices"]
