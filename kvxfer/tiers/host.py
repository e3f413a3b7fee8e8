"""The host tier: one buffer of fixed-size slots in host memory, allocated once.

Bytes only: which slot holds what is the index's business (kvxfer.index.block_index).
"""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.geometry.checksum import rows_checksums
from kvxfer.errors import InvalidArgument


class HostTier:
    """``capacity`` slots of ``slot_bytes`` each; pinned when a GPU will copy into it."""

    def __init__(self, capacity: int, slot_bytes: int, pin_memory: bool = False) -> None:
        if capacity < 1:
            raise InvalidArgument(f"host tier capacity must be at least 1 block, got {capacity}")
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        # Allocated once, up front: the tier never grows. Pages are touched now so
        # that the memory is really there (and counted) before the first offload.
        self.buffer = torch.zeros((capacity, slot_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._rows = self.buffer.numpy()

    @property
    def nbytes(self) -> int:
        return self.capacity * self.slot_bytes

    def checksums(self, slots: list[int]) -> list[int]:
        """The block checksum of each slot's bytes (kvxfer.geometry.checksum)."""
        rows: np.ndarray = self._rows
        return rows_checksums(rows[slot] for slot in slots)

    def slot_view(self, slot: int) -> torch.Tensor:
        """One slot's bytes (tests and tools)."""
        return self.buffer[slot]

