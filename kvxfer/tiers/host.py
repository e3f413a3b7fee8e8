"""The host tier: one buffer of fixed-size slots in host memory, allocated once.

Bytes only: which slot holds what is the index's business (kvxfer.index).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from kvxfer.errors import InvalidArgument
from kvxfer.geometry.checksum import rows_checksums
from kvxfer.memory.cuda_driver import driver
from kvxfer.records import TierKind
from kvxfer.tiers.base import Tier


class HostTier(Tier):
    """``capacity`` slots of ``slot_bytes`` each; page-locked for DMA when a GPU (``pin_device``)
    will copy into it."""

    kind = TierKind.HOST

    def __init__(self, capacity: int, slot_bytes: int, pin_device: int | None = None) -> None:
        if capacity < 1:
            raise InvalidArgument(f"host tier capacity must be at least 1 block, got {capacity}")
        super().__init__(capacity, slot_bytes)
        # Allocated once, up front: the tier never grows. Pages are touched now so
        # that the memory is really there (and counted) before the first offload.
        self.buffer = torch.zeros((capacity, slot_bytes), dtype=torch.uint8)
        self._rows: np.ndarray = self.buffer.numpy()
        if pin_device is not None:
            # Registered in place: torch's pinned allocator would round 100 GB up to 128 GB.
            gpu = driver(pin_device)
            gpu.pin(self.buffer.data_ptr(), capacity * slot_bytes)
            weakref.finalize(self, gpu.unpin, self.buffer.data_ptr())

    def write(self, slot: int, data: memoryview) -> None:
        """Store one block's bytes (``slot_bytes`` of them) in ``slot``."""
        self._rows[slot] = np.frombuffer(data, dtype=np.uint8)

    def read(self, slot: int) -> memoryview:
        """One slot's bytes (valid until the slot is freed)."""
        return memoryview(self._rows[slot])

    def checksums(self, slots: list[int]) -> list[int]:
        """The block checksum (kvxfer.geometry.checksum) of each slot's bytes."""
        rows = self._rows
        return rows_checksums(rows[slot] for slot in slots)
