"""The copy engine of a tensor-parallel rank's pool: its heads' slice of canonical blocks.

A host slot of a sharded cache group holds a canonical block (every head of every layer,
in the order L, H, N, KV, D: ``kvxfer.geometry.sharding``). A rank holding heads
``[first, end)`` owns, in each layer of a slot, one slice of it. Both sides are viewed
as tensors ``[blocks, L, H, N, KV, D]`` of the element's width (any pool layout is such a
strided view), so an offload is one gather of the rank's blocks written into its slice
of each slot, and a restore the reverse; torch makes the strided copies. Only the rank's
slice of a slot is touched: the other ranks write theirs at the same time.

Checksums are of the whole canonical block, so they are taken once every rank's slice is
in (``kvxfer.serving.pool_manager``), and a restore verifies the slot before copying from it
(``hashes_pool`` is False: a rank's pool holds only part of a block).
"""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.core.errors import Internal
from kvxfer.geometry.block_checksum import runs_checksum
from kvxfer.geometry.layout import Axis, PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import native
from kvxfer.transfer.copy_engine import CompletedHandle, CopyBatch, CopyEngine, CopyHandle, Direction
from kvxfer.transfer.cpu import NATIVE_STEP_BYTES
from kvxfer.transfer.plan import shard_pieces

#: Element widths -> an integer dtype of that width (the bytes move as they are, whatever the dtype:
#: torch has no index kernels for every float8).
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Pieces shorter than this move by torch: a memcpy and a hash call a piece would cost more.
NATIVE_PIECE_BYTES = 1024
#: The axes of both views, outermost first.
_AXES = (Axis.B, Axis.L, Axis.H, Axis.N, Axis.KV, Axis.D)


def blocks_view(storage: torch.Tensor, layout: PoolLayout) -> torch.Tensor:
    """A pool's bytes as ``[num_blocks, L, H, N, KV, D]`` words, whatever its layout (no copy)."""
    spec = layout.spec
    width = spec.element_size
    words = storage.view(_WORDS[width])
    return words.as_strided(tuple(spec.axis_size(a) for a in _AXES),
                            tuple(layout.strides[a] // width for a in _AXES), words.storage_offset())


class ShardCopyEngine(CopyEngine):
    """Moves one rank's heads between its pool (host memory) and canonical blocks in host slots."""

    def __init__(self, storage: torch.Tensor, layout: PoolLayout, heads: tuple[int, int], host: HostTier,
                 canonical: PoolLayout, threads: int = 2, use_native: bool = True) -> None:
        """``threads``: of the C loop and of the hashing of tier copies; ``use_native``: pieces of at least
        ``NATIVE_PIECE_BYTES`` move in the C loop where it is built (one memcpy a piece; else torch)."""
        first, end = heads
        if host.slot_bytes != canonical.block_bytes or end - first != layout.spec.num_kv_heads:
            raise Internal("a shard engine's slots hold canonical blocks, and its pool the rank's heads")
        self._layout = layout
        self._storage = storage
        self._threads = threads
        self._pool = blocks_view(storage, layout)
        s = canonical.spec  # BLHNC: a slot is [L, H, N, KV, D], contiguous
        shape = (host.capacity, s.num_layers, s.num_kv_heads, s.block_size, s.kv_parts, s.head_size)
        self._slots = host.buffer.view(_WORDS[s.element_size]).view(shape)[:, :, first:end]
        # The rank's pieces of a block (contiguous on both sides: one a layer in BLHNC and LBHNC) as rows
        # of the piece's length on both sides, which the C loop copies.
        offsets, places, piece = shard_pieces(layout, canonical, first)
        self._pieces = len(offsets)
        rows_fit = all(int(v) % piece == 0 for v in (*offsets, *places, layout.strides[Axis.B], host.slot_bytes))
        wanted = use_native and piece >= NATIVE_PIECE_BYTES and rows_fit
        self._native = native.load() if wanted else None
        if self._native is not None:
            self._pool_rows = storage.numpy().reshape(-1, piece)
            self._tier_rows = host.buffer.numpy().reshape(-1, piece)
            self._piece_rows, self._place_rows = offsets // piece, places // piece
            self._block_rows, self._slot_rows = layout.strides[Axis.B] // piece, host.slot_bytes // piece
            self._step = max(1, NATIVE_STEP_BYTES // piece)

    @property
    def descriptors_per_block(self) -> int:
        return self._pieces

    @property
    def hashes_pool(self) -> bool:
        return False  # the pool holds a slice of each block: verify the canonical copy

    def submit(self, batch: CopyBatch) -> CopyHandle:
        blocks = torch.as_tensor(batch.blocks, dtype=torch.long)
        slots = torch.as_tensor(list(batch.slots), dtype=torch.long)
        if blocks.numel() == 0:
            return CompletedHandle()
        if int(blocks.min()) < 0 or int(blocks.max()) >= len(self._pool) or int(slots.min()) < 0 \
                or int(slots.max()) >= len(self._slots):
            return CompletedHandle(Internal(f"{batch.direction.value} batch out of range"))
        if self._native is not None:
            return self._native_copy(batch.direction, blocks.numpy(), slots.numpy())
        try:
            if batch.direction is Direction.TO_HOST:
                self._slots.index_copy_(0, slots, self._pool.index_select(0, blocks))
            else:
                self._pool.index_copy_(0, blocks, self._slots.index_select(0, slots))
        except (RuntimeError, MemoryError) as exc:  # torch reports copy failures as these
            return CompletedHandle(Internal(f"{batch.direction.value} copy failed: {exc}"))
        return CompletedHandle()

    def _native_copy(self, direction: Direction, blocks: np.ndarray, slots: np.ndarray) -> CopyHandle:
        pool_rows = (blocks[:, None] * self._block_rows + self._piece_rows[None, :]).ravel()
        tier_rows = (slots[:, None] * self._slot_rows + self._place_rows[None, :]).ravel()
        pool, tier = self._pool_rows, self._tier_rows
        try:  # copies alone: a stored block is hashed whole once every rank's pieces are in
            if direction is Direction.TO_HOST:
                self._native.copy_rows(tier, pool, tier_rows, pool_rows, self._step, self._threads)
            else:
                self._native.copy_rows(pool, tier, pool_rows, tier_rows, self._step, self._threads)
        except Internal as exc:
            return CompletedHandle(exc)
        return CompletedHandle()

    @property
    def hash_threads(self) -> int:
        return self._threads

    def pool_checksums(self, blocks: list[int]) -> list[int]:
        """Of each pool block's own bytes (its runs in order): the rank's part, not a stored block's."""
        data = self._storage.numpy()
        return [runs_checksum(data[r.offset:r.end] for r in self._layout.block_runs(b)) for b in blocks]

    def describe(self) -> str:
        how = "C loop" if self._native is not None else "torch"
        return f"{type(self).__name__} (heads' slices of canonical blocks, {how}, {self._threads} threads)"
