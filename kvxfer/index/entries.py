"""What the block index answers with: plans for a batch, the entries it evicted, its statistics."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvxfer.core.records import Outcome, TierKind


@dataclass(frozen=True)
class Victim:
    """An entry evicted to make room: what a lower tier would need to keep it."""

    namespace: str
    key: bytes
    tier: TierKind
    checksum: int
    slot: int  # the tier slot it held (reused by the batch that evicted it: copy its bytes first)
    key_format: int = 0  # its key format's code (``kvxfer.events.event_records.format_code``), kept with it below


@dataclass(frozen=True)
class Evicted:
    """The entries one call evicted: their slots, and ``Victim``s when iterated (made only
    when someone looks: without lower tiers nobody does)."""

    tier: TierKind
    slots: Sequence[int] = field(default_factory=list)
    namespace_names: dict[int, str] = field(default_factory=dict)  # of the ids below, as they were then
    namespace_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    keys: Sequence[bytes] = field(default_factory=list)
    checksums: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    formats: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint8))  # key format codes

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[Victim]:
        names = self.namespace_names
        slots = self.slots.tolist() if isinstance(self.slots, np.ndarray) else self.slots
        formats = self.formats.tolist() if len(self.formats) else [0] * len(slots)
        for ns, key, checksum, slot, code in zip(self.namespace_ids.tolist(), self.keys, self.checksums.tolist(),
                                                 slots, formats):
            yield Victim(names[ns], key, self.tier, checksum, slot, code)


@dataclass
class Plan:
    """The index's answer to a batch: one outcome per key; the slots to move, with the
    batch position each belongs to; for a load, their checksums; the entries evicted to
    make room (their slots are reused by this batch).

    ``outcomes[positions[j]]`` belongs to ``slots[j]``; it reads DONE until the caller changes it.
    """

    outcomes: list[Outcome]
    slots: Sequence[int]  # a range when one extent holds them
    positions: Sequence[int]
    checksums: list[int] = field(default_factory=list)
    evicted: Evicted | None = None
    formats: list[int] = field(default_factory=list)  # for a load, each slot's key format code


class Entry(NamedTuple):
    """A complete entry, as listed for a checkpoint or a write-down."""

    namespace: str
    key: bytes
    slot: int
    checksum: int
    key_format: int = 0


@dataclass(frozen=True)
class IndexStats:
    tier: TierKind
    capacity: int
    used: int
    ready: int
    pinned: int
    evictions: int
    refaults: int = 0  # keys stored again soon after their eviction (kvxfer.index.refaults)
    tenants: tuple = ()  # each configured tenant's TenantStats, "other" first (kvxfer.index.tenancy)
