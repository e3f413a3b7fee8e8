"""The shared vocabulary of the client and the daemon: plain records and enums.

Imports nothing heavy (no torch, no gRPC), so that the client, the wire
conversions and the daemon speak the same words. Names, used the same way
everywhere (the proto's published field names excepted, see docs/design.md):

- **block**: one pool block, addressed by its block id (the API's ``slots``);
- **tier slot**: one fixed-size place in a tier (host memory, disk) holding a block;
- **token slot**: ``block * block_size + token`` in the attention kernels;
- **cache group**: pools that share a tier and its keys; **unix group**: a gid.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

#: Physical block 0 is never allocated and never written by a restore (vLLM's null block).
NULL_BLOCK = 0


class Outcome(enum.Enum):
    """What happened to one block of a well-formed request."""

    DONE = "done"
    ALREADY_PRESENT = "already_present"  # offload: the key is stored (or being stored); nothing copied
    NOT_FOUND = "not_found"  # restore: no complete entry for the key
    DATA_LOSS = "data_loss"  # restore: checksum mismatch; the entry was dropped; do not read the block
    RESOURCE_EXHAUSTED = "resource_exhausted"  # offload: tier full of pinned entries
    FAILED = "failed"  # the copy itself failed; nothing was stored / do not read the block
    CANCELLED = "cancelled"  # the job's lease ran out (or its pool went away) before this block was done
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the GPU copy did not finish in time; nothing stored / do not read
    NOT_ADMITTED = "not_admitted"  # offload: admission declined the new block (not a failure); nothing stored


class TierKind(enum.Enum):
    """Where a stored block lives."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"
    SHARED_FS = "shared_fs"
    PEER = "peer"  # another node's daemon, read over NIXL (kvxfer.peering)
    OBJECT = "object"  # object storage: S3 or S3-compatible, GCS, Azure Blob (kvxfer.tiers.object)


class Medium(enum.Enum):
    """Where a pool's bytes live and how another process maps them."""

    SHM = "shm"  # a file under a tmpfs directory, mapped MAP_SHARED
    CUDA = "cuda"  # device memory, mapped through a CUDA IPC handle
    MEMFD = "memfd"  # a sealed memfd of the daemon's; clients receive it over its descriptor socket


@dataclass(frozen=True)
class PoolRef:
    """The pool a request addresses, and the epoch the client mapped."""

    pool_id: str
    epoch: int
    token: bytes = b""  # a registered pool's registration token: its registrant's transfers present it


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


@dataclass(frozen=True)
class TransferStats:
    """Measured totals of one direction: blocks and bytes moved, and the seconds the moves took."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class LookupStats:
    """Keys asked about by Lookup and keys found (leading hits): hit ratio = hits / keys."""

    keys: int = 0
    hits: int = 0


@dataclass(frozen=True)
class TierStats:
    tier: TierKind
    capacity_blocks: int
    used_blocks: int
    ready_blocks: int
    pinned_blocks: int
    evictions: int
    slot_bytes: int
    degraded: bool = False  # an I/O error: the tier skips what fails and the host path goes on
    events: dict[str, int] = field(default_factory=dict)  # refaults; lower tiers: demoted, promoted, corrupt, ...
    loading: bool = False  # its index is still being loaded at start: it holds nothing for lookups yet
    tenants: tuple = ()  # host and disk tiers: each configured tenant's TenantStats, "other" first (kvxfer.index.tenancy)
    warming: bool = False  # the host tier: its memory is still being faulted in (a first write there faults)

    @property
    def has_occupancy(self) -> bool:
        """False for the tiers every node shares (Redis evicts on its own; a shared filesystem is
        filled by every node; a peer is another node's host tier): capacity, use and evictions
        are not ours to count (their figures here are zeros, not measurements)."""
        return self.tier not in (TierKind.REMOTE, TierKind.SHARED_FS, TierKind.PEER, TierKind.OBJECT)


@dataclass(frozen=True)
class JobStats:
    queued: int = 0
    running: int = 0
    unclaimed: int = 0  # finished, not yet collected with WaitJobs
    completed: int = 0
    cancelled: int = 0  # queued jobs whose lease ran out or whose pool went away
    expired: int = 0  # jobs or results dropped because their lease ran out


@dataclass(frozen=True)
class PoolStats:
    """One pool's figures; its tiers are its cache group's, shared with the group's other pools."""

    pool_id: str
    epoch: int
    cache_group: str
    tiers: list[TierStats]
    offloaded: TransferStats
    restored: TransferStats
    outcomes: dict[str, int] = field(default_factory=dict)  # per Outcome value: "done", "data_loss", ...
    jobs: JobStats = JobStats()
    lookups: LookupStats = LookupStats()
    block_tokens: int = 0  # tokens a block holds: a tier's capacity in tokens is capacity_blocks x this
