"""Layer-major and per-layer layouts through a staging buffer in device memory.

In such a layout a block is ``runs_per_block`` runs (one per layer, K/V and head,
as the layout orders them), each too short for a DMA descriptor to reach the link's
speed (measured on an H200, docs/benchmarks.md: LBHNC 0.06-0.42 of a contiguous
pinned copy where BLHNC moves 0.83-0.92). So a GPU offload first *gathers* each
block's runs into one contiguous row of a staging buffer (a Triton kernel on the
copy stream, once the engine's ready event completed) and then moves whole rows with one
descriptor each; a restore moves whole rows into staging and *scatters* them into
the pool. A staging row holds a block's runs in pool-offset order, which is the
tier slot's layout (``plan_copies``), so the tier bytes are the same either way.

The kernels run in stream order: on a GPU on the engine's stream itself; where
"device" memory is host memory (the CUDA simulator the tests run on) as a host
function on the stream (cuLaunchHostFunc), the Triton kernel under its interpreter.
"""

from __future__ import annotations

from ctypes import c_void_p
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.geometry.layout import Axis, PoolLayout
from kvxfer.memory.cuda_driver import Driver
from kvxfer.memory.cuda_mem import device_buffer
from kvxfer.transfer.device_checksum import upload as upload_ids
from kvxfer.transfer.plan import shard_rows

#: Runs shorter than this go through staging. Measured on an H200 (devcheck, scattered blocks
#: of one run each, fraction of a contiguous pinned copy): 512 KiB 0.83-0.88, 64 KiB 0.41-0.56.
STAGING_RUN_BYTES = 512 << 10
#: Bytes of one staging buffer; each direction has two (a chunk in flight while one is checked),
#: so a pool's engine holds 4 x 32 MiB of device memory once both directions have run.
STAGING_BUFFER_BYTES = 32 << 20
#: Words (of 8 bytes, or bytes where a run is not word-aligned) one program moves.
TILE = 1024


def wants_staging(layout: PoolLayout) -> bool:
    """Whether a layout's blocks move faster gathered into staging than as their runs."""
    return pieces_want_staging(Pieces.runs(layout))


def pieces_want_staging(pieces: Pieces) -> bool:
    """Whether blocks cut into these pieces move faster gathered into staging rows (a descriptor a row
    part) than as their pieces (a descriptor each): short pieces, more of them than row parts."""
    return (len(pieces.src) > len(pieces.slices[0]) and pieces.length < STAGING_RUN_BYTES
            and pieces.row <= STAGING_BUFFER_BYTES)


@dataclass(frozen=True)
class Pieces:
    """How a pool block moves through staging: piece o of block b lies at pool offset
    ``src[o] + b * block_stride`` and at ``dst[o]`` of the block's staging row (``row`` bytes);
    ``slices``: where a row goes in a tier slot, as (row offsets, slot offsets, length) of its parts."""

    src: np.ndarray
    dst: np.ndarray
    length: int
    block_stride: int
    row: int
    slices: tuple[np.ndarray, np.ndarray, int]

    @classmethod
    def runs(cls, layout: PoolLayout) -> Pieces:
        """A whole block's runs, back to back in pool-offset order: a row is the tier slot's bytes."""
        run, count = layout.run_length, layout.runs_per_block
        zero = np.zeros(1, dtype=np.int64)
        return cls(np.asarray(layout._outer_offsets, dtype=np.int64), np.arange(count, dtype=np.int64) * run, run,
                   layout.strides[Axis.B], layout.block_bytes, (zero, zero, layout.block_bytes))

    @classmethod
    def shard(cls, layout: PoolLayout, canonical: PoolLayout, first_head: int) -> Pieces:
        """A tensor-parallel rank's pieces of a block, gathered into its heads' slice of each layer in the
        canonical order: a row is ``L`` slices, each one contiguous run of a canonical slot."""
        src, dst, length, (rows, places, size) = shard_rows(layout, canonical, first_head)
        return cls(src, dst, length, layout.strides[Axis.B], layout.block_bytes, (rows, places, size))


def _unit(pieces: Pieces, pool: torch.Tensor, staging: torch.Tensor) -> int:
    """8 (words) when every piece and offset is word-aligned (one load per word), else 1 (bytes)."""
    values = [pieces.length, pieces.block_stride, pieces.row, pool.data_ptr(), staging.data_ptr()]
    aligned = all(v % 8 == 0 for v in values) and not (pieces.src % 8).any() and not (pieces.dst % 8).any()
    return 8 if aligned else 1


def _as_units(tensor: torch.Tensor, unit: int) -> torch.Tensor:
    return tensor if unit == 1 else tensor[:tensor.numel() // 8 * 8].view(torch.int64)


def move_pieces(pieces: Pieces, offsets: dict[int, tuple[torch.Tensor, torch.Tensor]], pool: torch.Tensor,
                staging: torch.Tensor, blocks: torch.Tensor, to_staging: bool) -> None:
    """Gather pool ``blocks`` into staging rows 0.. (``to_staging``), or scatter the rows back, on the
    current stream. ``blocks``: int64 block ids on the pool's device; ``offsets``: ``upload``'s."""
    n = blocks.numel()
    if n == 0:
        return
    from kvxfer.transfer.gpu_kernels import pieces_kernel  # (triton: only where a GPU path runs)

    unit = _unit(pieces, pool, staging)
    piece_units = pieces.length // unit
    tile = min(TILE, 1 << (piece_units - 1).bit_length())  # a power of two: Triton's arange needs one
    grid = (n * len(pieces.src), -(-piece_units // tile))
    src, dst = offsets[unit]
    pieces_kernel[grid](_as_units(pool, unit), _as_units(staging, unit), blocks, src, dst, piece_units,
                        len(pieces.src), pieces.block_stride // unit, pieces.row // unit, TO_STAGING=to_staging,
                        TILE=tile)


def upload(pieces: Pieces, device: torch.device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The pieces' offsets in bytes (key 1) and in words (key 8), on ``device`` (set-up: uploads)."""
    return {unit: (torch.from_numpy(pieces.src // unit).to(device), torch.from_numpy(pieces.dst // unit).to(device))
            for unit in (1, 8)}


def move_pieces_torch(pieces: Pieces, pool: torch.Tensor, staging: torch.Tensor, blocks: list[int],
                      to_staging: bool) -> None:
    """The torch twin of ``move_pieces`` (the same bytes, by index arithmetic): the reference the
    kernel is tested against."""
    if not blocks:
        return
    span = torch.arange(pieces.length, dtype=torch.int64)[None, :]
    b = torch.tensor(blocks, dtype=torch.int64)[:, None]
    pool_index = ((b * pieces.block_stride + torch.from_numpy(pieces.src)[None, :]).reshape(-1, 1) + span).reshape(-1)
    rows = torch.arange(len(blocks), dtype=torch.int64)[:, None] * pieces.row
    staging_index = ((rows + torch.from_numpy(pieces.dst)[None, :]).reshape(-1, 1) + span).reshape(-1)
    if to_staging:
        staging[staging_index] = pool[pool_index]
    else:
        pool[pool_index] = staging[staging_index]


class Stager:
    """The staging kernels of one pool, enqueued on a copy stream in its order."""

    def __init__(self, pool: torch.Tensor, pieces: Pieces, driver: Driver) -> None:
        self.pool, self.pieces, self.driver = pool, pieces, driver
        self.rows = STAGING_BUFFER_BYTES // pieces.row  # blocks one buffer holds
        self._offsets = upload(pieces, pool.device)  # now, not in a submit: the upload synchronises
        self._streams: dict[int, torch.cuda.ExternalStream] = {}

    def buffer(self) -> torch.Tensor:
        """A staging buffer in the pool's device memory (each stream of the engine holds two)."""
        return device_buffer(self.driver, self.rows * self.pieces.row)

    def descriptors(self, buffer: torch.Tensor, slots: np.ndarray, slot_bytes: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(staging addresses, tier offsets, sizes) moving rows 0.. to or from tier ``slots``: one a row
        (a whole block), or one a layer's slice of a canonical slot (a rank's row)."""
        rows, places, size = self.pieces.slices
        row_starts = buffer.data_ptr() + np.arange(len(slots), dtype=np.int64) * self.pieces.row
        staging = (row_starts[:, None] + rows[None, :]).ravel()
        tier = (slots[:, None] * slot_bytes + places[None, :]).ravel()
        return staging, tier, np.full(len(staging), size, dtype=np.int64)

    def enqueue(self, stream: c_void_p, buffer: torch.Tensor, blocks: list[int], to_staging: bool) -> None:
        """Gather pool ``blocks`` into ``buffer``'s rows 0.. (``to_staging``), or scatter the rows into
        them, after what is enqueued on ``stream``. Raises RuntimeError if the kernel cannot be
        enqueued (the caller lets what came before land)."""
        ids = np.asarray(blocks, dtype=np.int64)
        if not self.pool.is_cuda:  # "device" memory is host memory: a host function in stream order
            tensor = torch.from_numpy(ids)
            self.driver.launch_host(stream, lambda: move_pieces(self.pieces, self._offsets, self.pool, buffer, tensor,
                                                                to_staging))
            return
        if stream.value not in self._streams:
            self._streams[stream.value] = torch.cuda.ExternalStream(stream.value, device=self.pool.device)
        with torch.cuda.stream(self._streams[stream.value]):
            move_pieces(self.pieces, self._offsets, self.pool, buffer, upload_ids(ids, self.pool.device), to_staging)
