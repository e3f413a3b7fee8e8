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
import hashlib
from dataclasses import dataclass, field

from kvxfer.v1 import kvxfer_pb2 as _pb  # (protobuf only: the API's enums)

#: Physical block 0 is never allocated and never written by a restore (vLLM's null block).
NULL_BLOCK = 0


def digest(*parts: object, size: int = 16) -> str:
    """A short hex name for ``parts`` (fingerprints, tenants, pool ids of the engine backends)."""
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:size]


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


#: Where a stored block lives: one member per value of the API's ``Tier`` enum (``TIER_SHARED_FS`` is
#: ``TierKind.SHARED_FS``, "shared_fs"), so that a new tier's kind is its proto value and nothing else. The
#: lower tiers' rows (``kvxfer.tiers.registry``) say the rest: HOST, DISK (this node's), REMOTE (Redis),
#: SHARED_FS, PEER (another node's daemon, over NIXL), OBJECT (a bucket), MOONCAKE (a Mooncake Store).
TierKind = enum.Enum("TierKind", [(name.removeprefix("TIER_"), name.removeprefix("TIER_").lower())
                                  for name in _pb.Tier.keys() if name != "TIER_UNSPECIFIED"], module=__name__)
#: Each kind's value of the API's ``Tier`` enum, both ways (the client, the daemon and the events read the same).
TIER_TO_PB = {kind: _pb.Tier.Value(f"TIER_{kind.name}") for kind in TierKind}
PB_TO_TIER = {v: k for k, v in TIER_TO_PB.items()}


class HintAction(enum.Enum):
    """What an engine, router or application says of blocks it names (docs/api.md, Hint)."""

    PREFETCH = "prefetch"  # bring them up to the host tier now (lowest priority, cancellable)
    RETAIN = "retain"  # evicted last until a TTL passes
    RELEASE = "release"  # the session ended: evicted first (a later read makes them ordinary again)
    CANCEL = "cancel"  # drop the prefetches queued under a request id
    ENVELOPE = "envelope"  # a router's hint envelope (kvxfer.core.envelope): its actions, each one of the above


class EvictionReason(enum.Enum):
    """Why a block left a tier to make room: which part of the order it was taken from."""

    RELEASED = "released"  # released by a hint, unread since
    LRU = "lru"  # least recently used among the ordinary blocks
    RETAINED = "retained"  # retained, taken last: nothing else was evictable


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
        """False for the tiers every node shares (Redis and Mooncake evict on their own; a shared filesystem
        or a bucket is filled by every node; a peer is another node's host tier): they report no capacity,
        for capacity, use and evictions are not ours to count (their figures are zeros, not measurements)."""
        return self.capacity_blocks > 0


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
