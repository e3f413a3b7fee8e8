"""Layer-major and per-layer layouts through a staging buffer in device memory.

In such a layout a block is ``runs_per_block`` runs (one per layer, K/V and head,
as the layout orders them), each too short for a DMA descriptor to reach the link's
speed (measured on an H200, docs/benchmarks.md: LBHNC 0.06-0.42 of a contiguous
pinned copy where BLHNC moves 0.83-0.92). So a GPU offload first *gathers* each
block's runs into one contiguous row of a staging buffer (a Triton kernel on the
copy stream, after the engine's ready event) and then moves whole rows with one
descriptor each; a restore moves whole rows into staging and *scatters* them into
the pool. A staging row holds a block's runs in pool-offset order, which is the
tier slot's layout (``plan_copies``), so the tier bytes are the same either way.

The kernels run in stream order: on a GPU on the engine's stream itself; where
"device" memory is host memory (the CUDA simulator the tests run on) as a host
function on the stream (cuLaunchHostFunc), the Triton kernel under its interpreter.
"""

from __future__ import annotations

from ctypes import c_void_p

import numpy as np
import torch
import triton
import triton.language as tl

from kvxfer.geometry.layout import PoolLayout
from kvxfer.memory.cuda_driver import Driver
from kvxfer.memory.cuda_mem import device_buffer
from kvxfer.transfer.device_checksum import upload

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
    return (layout.runs_per_block > 1 and layout.run_length < STAGING_RUN_BYTES
            and layout.block_bytes <= STAGING_BUFFER_BYTES)


@triton.jit
def _runs_kernel(pool_ptr, staging_ptr, blocks_ptr, outer_ptr, run_units, runs_per_block,
                 TO_STAGING: tl.constexpr, TILE: tl.constexpr):
    """Program (i * runs_per_block + o, t): tile t of run o of the i-th block, between the pool
    (run o of block b at outer[o] + b * run_units) and staging row i (run o at o * run_units)."""
    pair = tl.program_id(0).to(tl.int64)
    i, o = pair // runs_per_block, pair % runs_per_block
    block = tl.load(blocks_ptr + i).to(tl.int64)
    pool_start = tl.load(outer_ptr + o).to(tl.int64) + block * run_units
    staging_start = pair * run_units  # row i, run o: (i * runs_per_block + o) * run_units
    idx = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = idx < run_units
    if TO_STAGING:
        tl.store(staging_ptr + staging_start + idx, tl.load(pool_ptr + pool_start + idx, mask=mask), mask=mask)
    else:
        tl.store(pool_ptr + pool_start + idx, tl.load(staging_ptr + staging_start + idx, mask=mask), mask=mask)


def _units(layout: PoolLayout, pool: torch.Tensor, staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The pool and staging as 8-byte words when every run is word-aligned (one load per word), else bytes."""
    run = layout.run_length
    aligned = (run % 8 == 0 and pool.data_ptr() % 8 == 0 and staging.data_ptr() % 8 == 0
               and all(o % 8 == 0 for o in layout._outer_offsets))
    if not aligned:
        return pool, staging, 1
    return pool[:pool.numel() // 8 * 8].view(torch.int64), staging[:staging.numel() // 8 * 8].view(torch.int64), 8


def move_runs(layout: PoolLayout, pool: torch.Tensor, staging: torch.Tensor, blocks: torch.Tensor,
              outer: torch.Tensor, to_staging: bool) -> None:
    """Gather pool ``blocks`` into staging rows 0.. (``to_staging``), or scatter the rows back, on
    the current stream. ``blocks``: int64 block ids on the pool's device; ``outer``: the layout's
    run offsets in the same units as ``_units`` chooses (``outer_offsets``)."""
    n = blocks.numel()
    if n == 0:
        return
    pool_units, staging_units, unit = _units(layout, pool, staging)
    run_units = layout.run_length // unit
    tile = min(TILE, triton.next_power_of_2(run_units))
    grid = (n * layout.runs_per_block, triton.cdiv(run_units, tile))
    _runs_kernel[grid](pool_units, staging_units, blocks, outer[unit], run_units, layout.runs_per_block,
                       TO_STAGING=to_staging, TILE=tile)


def outer_offsets(layout: PoolLayout, device: torch.device) -> dict[int, torch.Tensor]:
    """Block 0's run offsets in bytes (key 1) and in words (key 8), on ``device`` (set-up: uploads)."""
    offsets = np.asarray(layout._outer_offsets, dtype=np.int64)
    return {unit: torch.from_numpy(offsets // unit).to(device) for unit in (1, 8)}


def move_runs_torch(layout: PoolLayout, pool: torch.Tensor, staging: torch.Tensor, blocks: list[int],
                    to_staging: bool) -> None:
    """The torch twin of ``move_runs`` (the same bytes, by index arithmetic): the reference the
    kernel is tested against."""
    run, rows = layout.run_length, len(blocks)
    if rows == 0:
        return
    starts = (torch.tensor(blocks, dtype=torch.int64)[:, None] * run
              + torch.tensor(layout._outer_offsets, dtype=torch.int64)[None, :]).reshape(-1)
    index = (starts[:, None] + torch.arange(run, dtype=torch.int64)[None, :]).reshape(-1)
    row_bytes = rows * layout.block_bytes
    if to_staging:
        staging[:row_bytes] = pool[index]
    else:
        pool[index] = staging[:row_bytes]


class Stager:
    """The staging kernels of one pool, enqueued on a copy stream in its order."""

    def __init__(self, pool: torch.Tensor, layout: PoolLayout, driver: Driver) -> None:
        self.pool, self.layout, self.driver = pool, layout, driver
        self.rows = STAGING_BUFFER_BYTES // layout.block_bytes  # blocks one buffer holds
        self._outer = outer_offsets(layout, pool.device)  # now, not in a submit: the upload synchronises
        self._streams: dict[int, torch.cuda.ExternalStream] = {}

    def buffer(self) -> torch.Tensor:
        """A staging buffer in the pool's device memory (each stream of the engine holds two)."""
        return device_buffer(self.driver, self.rows * self.layout.block_bytes)

    def enqueue(self, stream: c_void_p, buffer: torch.Tensor, blocks: list[int], to_staging: bool) -> None:
        """Gather pool ``blocks`` into ``buffer``'s rows 0.. (``to_staging``), or scatter the rows into
        them, after what is enqueued on ``stream``. Raises RuntimeError if the kernel cannot be
        enqueued (the caller lets what came before land)."""
        ids = np.asarray(blocks, dtype=np.int64)
        if not self.pool.is_cuda:  # "device" memory is host memory: a host function in stream order
            tensor = torch.from_numpy(ids)
            self.driver.launch_host(stream, lambda: move_runs(self.layout, self.pool, buffer, tensor, self._outer,
                                                              to_staging))
            return
        if stream.value not in self._streams:
            self._streams[stream.value] = torch.cuda.ExternalStream(stream.value, device=self.pool.device)
        with torch.cuda.stream(self._streams[stream.value]):
            move_runs(self.layout, self.pool, buffer, upload(ids, self.pool.device), self._outer, to_staging)
