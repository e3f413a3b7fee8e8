"""The tier interface: a bounded store of fixed-size slots, one block each.

Host memory, disk and a remote store are siblings behind it. A tier owns its
free-slot bookkeeping (``slots``; the index reserves and frees through it, under
the index's lock) and its bytes. Which key a slot holds is the index's business;
copy engines reach a host tier's buffer directly, a lower tier moves whole blocks
between its medium and host memory (``kvxfer.tiers.disk.files``).
"""

from __future__ import annotations

from kvxfer.core.records import TierKind
from kvxfer.core.slots import SlotAllocator


class Tier:
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
