"""The interface every tier below host memory implements: the disk, Redis, and whatever comes next.

A cache group holds an ordered list of lower tiers and drives them through this protocol
alone (``kvxfer.serving.group``): blocks the host tier evicts (and, for a write-through
tier, blocks just stored) are *staged* into it, never waited for; a restore of keys the
host tier lacks *fetches* them from the first tier that has them, straight into reserved
host slots, with a verdict per key (``kvxfer.serving.promotion`` does the host side once
for all tiers); a Delete removes keys from all of them, including writes still queued.
A tier knows of its group only what ``GroupContext`` says. A new tier is one module implementing
this, its config section, and a row in ``kvxfer.tiers.registry.LOWER_TIERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvxfer.core.records import Outcome, TierKind, TierStats
from kvxfer.events.event_hub import EventHub, ScopedEvents
from kvxfer.index.block_index import BlockIndex
from kvxfer.tiers.reach import SHARED, Reach

#: (key, checksum, the block's bytes in a host slot) as staged into a lower tier.
StagedBlock = tuple[bytes, int, torch.Tensor]


@dataclass(frozen=True)
class GroupContext:
    """What a lower tier is told of the cache group it serves; it knows nothing else of it."""

    name: str
    block_bytes: int
    fingerprint: bytes  # the block format bound to this group (``BlockFormat.bound_to``): kept with every block
    format_fingerprint: bytes  # the block format alone (``BlockFormat.fingerprint``): what peers match groups by
    host_memory: tuple[int, int]  # (address, bytes) of the group's host tier, where fetched blocks land
    events: EventHub | ScopedEvents | None = None  # where the tier announces blocks stored and removed
    #: the checksum of each host slot's bytes (host slots numbered from ``host_memory``'s address), off the GIL
    checksums: Callable[[list[int]], list[int]] | None = None
    tenants: tuple = ()  # the configured tenants (``kvxfer.index.tenancy.Tenant``): a tier of its own divides by them
    reach: Reach = SHARED  # who may find its blocks on the tiers other nodes read (``kvxfer.tiers.reach``)


class Fetch(Protocol):
    """The blocks of one restore a lower tier holds, held (not evicted) until ``end``."""

    keys: list[bytes]  # the requested keys this tier holds, in request order
    formats: list[int]  # each one's key format code, as the tier kept it (known once ``read``)

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        """Copy ``keys[j]``'s verified bytes into each (j, host slot) target; per target DONE and the
        block's checksum, DATA_LOSS (wrong bytes: removed from the tier), FAILED (the medium
        failed) or NOT_FOUND (not read after all: left to the host tier)."""
        ...

    def end(self, corrupt: set[int]) -> None:
        """Release what ``fetch`` held; ``corrupt``: positions in ``keys`` found DATA_LOSS."""
        ...


class LowerTier(Protocol):
    """A tier below host memory, as a cache group sees it."""

    kind: TierKind
    takes_evictions: bool  # blocks the host tier evicts are staged here (demotion)
    takes_stores: bool  # blocks just stored are staged here too (write-through)
    restart_warm: bool  # the daemon writes the host tier down here at SIGTERM (``write_now``)
    index: BlockIndex | None  # its own index of the keys it holds, if it keeps one (a Snapshot lists it)

    def stage(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> None:
        """Copy the blocks out now (their host slots are reused next) and write them later; never
        waits on the medium (a full queue drops and counts). ``key_format``: the keys' format code, kept
        with the blocks (their events name them by it, also after a restart)."""
        ...

    def write_now(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> int:
        """Write blocks on this thread, durably; returns how many were."""
        ...

    def wait_ready(self, until: float) -> bool:
        """Wait (on a worker thread) until the tier answers for all it holds (an index still loading at
        start holds nothing yet), or until ``until`` (``time.monotonic()``); True if it does."""
        ...

    def contains(self, namespace: str, keys: list[bytes], until: float | None = None) -> list[bool]:
        """Which keys the tier holds; asking the medium ends by ``until`` (the request's deadline,
        ``time.monotonic()``; None: the tier's own timeout), what is not answered by then a miss."""
        ...

    def fetch(self, namespace: str, keys: list[bytes]) -> Fetch:
        ...

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the keys, and drop their writes still queued; returns how many were held."""
        ...

    def stats(self) -> TierStats:
        ...

    def flush(self, timeout: float) -> bool:
        ...

    def close(self, timeout: float = 0.0) -> None:
        ...


class CheckedLater(Fetch, Protocol):
    """A fetch whose blocks may be checked by whoever copies them next (a restore's copy into the engine's pool
    hashes as it copies), not in a pass of their own."""

    checks_later: bool  # True

    def read(self, targets: list[tuple[int, torch.Tensor]], check: bool = True) -> list[tuple[Outcome, int]]:
        """As ``Fetch.read``; ``check=False``: DONE means read, not checked, and carries the checksum the block must
        have. Whoever copies it compares, then says what it found (``checked``)."""
        ...

    def mismatch(self, j: int) -> Outcome:
        """What block ``j``, read unchecked, is when its bytes turn out wrong: DATA_LOSS, or NOT_FOUND where they
        could have changed under the read (the tier's hold on it ended first)."""
        ...

    def checked(self, good: dict[int, bool]) -> set[int]:
        """Every block read unchecked was checked (``good[j]``); returns the positions to report corrupt (``end``)."""
        ...


#: What a cache group is given at construction: its lower tiers, top down (``kvxfer.tiers.registry``).
LowerTierFactory = Callable[[GroupContext], list[LowerTier]]


class Nothing:
    """A fetch that found nothing."""

    keys: list[bytes] = []
    formats: list[int] = []

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        return []

    def end(self, corrupt: set[int]) -> None:
        return None
