"""Bounds on what clients may make the daemon hold, and how its pools are served (the config's values)."""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Limits:
    """Bounds on what clients may make the daemon hold."""

    max_pools: int = 8
    max_cache_groups: int = 8  # groups outlive their pools (the warm cache outlives the engine)
    max_queued_jobs: int = 256
    default_lease_s: float = 30.0
    max_lease_s: float = 600.0
    allow_register: bool = True
    registered_host_capacity_mib: int = 512  # default and maximum host tier of a registered pool
    max_jobs_per_client: int = 64  # queued + uncollected jobs of one client_id on one pool
    cache_group_retention_s: float = 300.0  # a group without pools keeps its blocks this long
    checksum_on_device: bool = True  # GPU pools: block checksums by the device XXH3, behind each copy
    copy_threads: int = 2  # threads of each CPU pool's copy engine
    gpu_copy_deadline_s: float = 30.0  # a GPU copy not done by then fails its job (DEADLINE_EXCEEDED)
    allow_overcommit: bool = False  # a registered pool's host tier may exceed the memory free here
