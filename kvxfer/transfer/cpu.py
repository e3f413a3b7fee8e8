"""The CPU copy engine: batched gathers and scatters, no per-block Python loop.

A block is ``outer`` runs (1 for block-major layouts); a run is moved as one row
of the widest integer type that divides it (int64 where the run is a multiple of
8 bytes: index_select on wide rows is much faster than on uint8; docs/benchmarks.md).
A host slot holds a block's runs back to back, in ascending pool offset order.
"""

from __future__ import annotations

import torch

from kvxfer.geometry.checksum import rows_checksums, runs_checksum
from kvxfer.errors import Internal
from kvxfer.geometry.layout import PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.base import CompletedHandle, CopyBatch, CopyEngine, CopyHandle, Direction

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)

#: Beyond this many pieces of consecutive host slots, one gather through a
#: temporary beats many small calls writing in place.
MAX_PIECES = 8


def word_type(run_bytes: int, *pointers: int) -> torch.dtype:
    """The widest integer type that divides ``run_bytes`` and aligns every pointer."""
    for dtype in _WORDS:
        size = dtype.itemsize
        if run_bytes % size == 0 and all(p % size == 0 for p in pointers):
            return dtype
    return torch.uint8


def consecutive_pieces(slots: list[int]) -> list[tuple[int, int]]:
    """Index ranges [a, b) over which ``slots`` increases by exactly 1."""
    if slots and slots == list(range(slots[0], slots[0] + len(slots))):
        return [(0, len(slots))]  # the usual case: the allocator gave one extent
    pieces: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(slots)):
        if slots[i] != slots[i - 1] + 1:
            pieces.append((start, i))
            start = i
    if slots:
        pieces.append((start, len(slots)))
    return pieces


class CpuCopyEngine(CopyEngine):
    """Copies between a pool in host memory (shared memory) and the host tier.

    Both sides are viewed as rows of one run each: pool row ``o * num_blocks + b``
    is run ``o`` of block ``b``; tier row ``slot * outer + o`` is run ``o`` of a
    slot. A batch is then one ``index_select`` (offload) or ``index_copy_``
    (restore) per piece of consecutive tier slots, for every layout.
    """

    def __init__(self, storage: torch.Tensor, layout: PoolLayout, host: HostTier) -> None:
        if host.slot_bytes != layout.block_bytes:
            raise Internal(f"host slots of {host.slot_bytes} B cannot hold blocks of {layout.block_bytes} B")
        outer, run = layout.runs_per_block, layout.run_length
        word = word_type(run, storage.data_ptr(), host.buffer.data_ptr())
        words = run // word.itemsize
        self._outer = outer
        self._pool_rows = storage.view(word).view(outer * layout.spec.num_blocks, words)
        self._host_rows = host.buffer.view(word).view(host.capacity * outer, words)
        # Row offset of each run position: block b's runs are rows b + run_offsets.
        self._run_offsets = torch.arange(outer, dtype=torch.int64) * layout.spec.num_blocks
        self.word = word
        self._layout = layout
        self._pool_bytes = storage.numpy()

    @property
    def descriptors_per_block(self) -> int:
        return self._outer

    def submit(self, batch: CopyBatch) -> CopyHandle:
        if batch.ready_event:
            return CompletedHandle(Internal("a CUDA event handle reached the CPU copy engine"))
        try:
            rows = self._pool_row_index(batch.blocks)
            if batch.direction is Direction.TO_HOST:
                self._to_host(rows, batch.slots)
            else:
                self._to_pool(rows, batch.slots)
        except (RuntimeError, IndexError) as exc:  # torch reports copy failures as these
            return CompletedHandle(Internal(f"{batch.direction.value} copy failed: {exc}"))
        return CompletedHandle()

    def pool_checksums(self, blocks: list[int]) -> list[int]:
        data, span = self._pool_bytes, self._layout.block_bytes
        if self._outer == 1:
            return rows_checksums(data[b * span:(b + 1) * span] for b in blocks)
        return [runs_checksum(data[r.offset:r.end] for r in self._layout.block_runs(b)) for b in blocks]

    def _pool_row_index(self, blocks: list[int]) -> torch.Tensor:
        """Pool rows in tier order: for each block, its runs in ascending offset order."""
        index = torch.tensor(blocks, dtype=torch.int64)
        if self._outer == 1:
            return index
        return (index[:, None] + self._run_offsets[None, :]).reshape(-1)

    def _tier_row_index(self, slots: list[int]) -> torch.Tensor:
        index = torch.tensor(slots, dtype=torch.int64)
        if self._outer == 1:
            return index
        return (index[:, None] * self._outer + torch.arange(self._outer)[None, :]).reshape(-1)

    def _to_host(self, rows: torch.Tensor, slots: list[int]) -> None:
        pieces = consecutive_pieces(slots)
        k = self._outer
        if len(pieces) <= MAX_PIECES:
            for a, b in pieces:  # gather straight into consecutive slots
                first = slots[a] * k
                torch.index_select(self._pool_rows, 0, rows[a * k:b * k], out=self._host_rows[first:first + (b - a) * k])
        else:
            self._host_rows.index_copy_(0, self._tier_row_index(slots), self._pool_rows.index_select(0, rows))

    def _to_pool(self, rows: torch.Tensor, slots: list[int]) -> None:
        pieces = consecutive_pieces(slots)
        k = self._outer
        if len(pieces) <= MAX_PIECES:
            for a, b in pieces:  # scatter straight from consecutive slots
                first = slots[a] * k
                self._pool_rows.index_copy_(0, rows[a * k:b * k], self._host_rows[first:first + (b - a) * k])
        else:
            self._pool_rows.index_copy_(0, rows, self._host_rows.index_select(0, self._tier_row_index(slots)))
