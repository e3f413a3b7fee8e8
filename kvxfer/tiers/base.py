"""The tier interface: a bounded store of fixed-size slots, one block each.

Host memory, disk and a remote store are siblings behind it. A tier owns its
free-slot bookkeeping (``slots``; the index reserves and frees through it, under
the index's lock) and its bytes (``write``, ``read``, ``checksums``). Which key a
slot holds is the index's business; copy engines reach a host tier's buffer
directly, lower tiers go through ``write`` and ``read``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvxfer.index.slots import SlotAllocator
from kvxfer.records import TierKind


class Tier(ABC):
    kind: TierKind

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self.slots = SlotAllocator(capacity)

    def reserve(self, n: int) -> list[int] | None:
        """``n`` free slots, or None (nothing taken) if fewer are free."""
        return self.slots.allocate(n)

    def free(self, slots: list[int]) -> None:
        self.slots.release_many(slots)

    @abstractmethod
    def write(self, slot: int, data: memoryview) -> None:
        """Store one block's bytes (``slot_bytes`` of them) in ``slot``."""

    @abstractmethod
    def read(self, slot: int) -> memoryview:
        """One slot's bytes (valid until the slot is freed)."""

    @abstractmethod
    def checksums(self, slots: list[int]) -> list[int]:
        """The block checksum (kvxfer.geometry.checksum) of each slot's bytes."""
