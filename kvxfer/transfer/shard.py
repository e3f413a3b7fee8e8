"""The copy engine of a tensor-parallel rank's pool: its heads' slice of canonical blocks.

A host slot of a sharded cache group holds a canonical block (every head of every layer,
in the order L, H, N, KV, D: ``kvxfer.geometry.sharding``). A rank holding heads
``[first, end)`` owns, in each layer of a slot, one slice of it. Both sides are viewed
as tensors ``[blocks, L, H, N, KV, D]`` of the element's width (any pool layout is such a
strided view), so an offload is one gather of the rank's blocks written into its slice
of each slot, and a restore the reverse; torch makes the strided copies. Only the rank's
slice of a slot is touched: the other ranks write theirs at the same time.

Checksums are of the whole canonical block, so they are taken once every rank's slice is
in (``kvxfer.serving.manager``), and a restore verifies the slot before copying from it
(``hashes_pool`` is False: a rank's pool holds only part of a block).
"""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.errors import Internal
from kvxfer.geometry.checksum import runs_checksum
from kvxfer.geometry.layout import Axis, PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import native
from kvxfer.transfer.base import CompletedHandle, CopyBatch, CopyEngine, CopyHandle, Direction
from kvxfer.transfer.cpu import NATIVE_STEP_BYTES

#: Element widths -> an integer dtype of that width (the bytes move as they are, whatever the dtype:
#: torch has no index kernels for every float8).
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
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
        """``threads``: of the C loop and of the hashing of tier copies; ``use_native``: a BLHNC pool's
        slices move in the C loop where it is built (one memcpy a layer; else torch)."""
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
        # A BLHNC pool's block is, layer by layer, the rank's slice of each layer of a slot: rows of one
        # layer's slice on both sides (the C loop copies rows, and hashes the pool block it copied as it goes).
        self._native = native.load() if use_native and layout.layout == canonical.layout else None
        if self._native is not None:
            layers, row = s.num_layers, layout.block_bytes // s.num_layers
            self._pool_rows = storage.numpy().reshape(-1, row)
            self._pool_spans = storage.numpy().reshape(layout.spec.num_blocks, layout.block_bytes)
            self._tier_rows = host.buffer.numpy().reshape(-1, row)
            share = s.num_kv_heads // (end - first)  # slices a slot's layer holds
            self._row_of_layer = np.arange(layers, dtype=np.int64)
            self._tier_row_of_layer = self._row_of_layer * share + first // (end - first)
            self._rows_per_slot = layers * share
            self._step = max(1, NATIVE_STEP_BYTES // layout.block_bytes)

    @property
    def descriptors_per_block(self) -> int:
        return self._layout.spec.num_layers * self._layout.runs_per_block

    @property
    def hashes_pool(self) -> bool:
        return False  # the pool holds a slice of each block: verify the canonical copy

    def submit(self, batch: CopyBatch) -> CopyHandle:
        if batch.ready_event:
            return CompletedHandle(Internal("a CUDA event handle reached the CPU shard engine"))
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
        pool_rows = (blocks[:, None] * len(self._row_of_layer) + self._row_of_layer[None, :]).ravel()
        tier_rows = (slots[:, None] * self._rows_per_slot + self._tier_row_of_layer[None, :]).ravel()
        pool, tier = self._pool_rows, self._tier_rows
        try:
            if direction is Direction.TO_HOST:
                self._native.copy_hash(tier, pool, tier_rows, pool_rows, self._pool_spans, blocks, self._step,
                                       self._threads)
            else:
                self._native.copy_hash(pool, tier, pool_rows, tier_rows, self._pool_spans, blocks, self._step,
                                       self._threads)
        except Internal as exc:
            return CompletedHandle(exc)
        return CompletedHandle()  # (the sums are of the rank's part: the stored block is hashed whole)

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
