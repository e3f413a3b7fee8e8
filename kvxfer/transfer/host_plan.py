"""The host plan executor: a copy plan's descriptors run as memmoves on mapped host memory.

The reference executor of ``kvxfer.transfer.plan`` (what the CUDA engine hands the
driver, executed by the CPU): the tests prove it byte-equal to the gather engine for
every layout. CPU pools keep the gather engine (``CpuCopyEngine``): a gather moves
a batch in one call, this pays one call per descriptor (measured side by side in
docs/benchmarks.md, ``kvxfer bench store --engine plan``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.core.errors import Internal
from kvxfer.geometry.block_checksum import rows_checksums, runs_checksum
from kvxfer.geometry.layout import PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CompletedHandle, CopyBatch, CopyEngine, CopyHandle, Direction
from kvxfer.transfer.plan import plan_copies


class HostPlanEngine(CopyEngine):
    """Executes copy plans between a mapped host pool and the host tier."""

    def __init__(self, storage: torch.Tensor, layout: PoolLayout, host: HostTier) -> None:
        if host.slot_bytes != layout.block_bytes:
            raise Internal(f"host slots of {host.slot_bytes} B cannot hold blocks of {layout.block_bytes} B")
        self._pool: np.ndarray = storage.numpy()
        self._tier: np.ndarray = host.buffer.numpy().reshape(-1)
        self._layout = layout

    @property
    def descriptors_per_block(self) -> int:
        return self._layout.runs_per_block

    def submit(self, batch: CopyBatch) -> CopyHandle:
        plan = plan_copies(self._layout, batch.blocks, batch.slots)
        pool, tier = self._pool, self._tier
        to_host = batch.direction is Direction.TO_HOST
        for p, t, n in zip(plan.pool_offsets.tolist(), plan.tier_offsets.tolist(), plan.nbytes.tolist()):
            if to_host:
                tier[t:t + n] = pool[p:p + n]
            else:
                pool[p:p + n] = tier[t:t + n]
        return CompletedHandle()

    def pool_checksums(self, blocks: list[int]) -> list[int]:
        data, span = self._pool, self._layout.block_bytes
        if self._layout.runs_per_block == 1:
            return rows_checksums(data[b * span:(b + 1) * span] for b in blocks)
        return [runs_checksum(data[r.offset:r.end] for r in self._layout.block_runs(b)) for b in blocks]
