"""Slot mapping: the pool slot each new token of a batch is written to.

For token ``i`` of request ``r`` at position ``pos`` (global within its request):
``slot = block_table[r][pos // N] * N + pos % N`` (int64), where ``N`` is the block
size. Tokens ``[num_tokens, max_num_tokens)`` (CUDA-graph padding) get -1
(PAD_SLOT_ID): a cache write skips them. Recomputed every step, never stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAD_SLOT_ID = -1
TILE = 128


@triton.jit
def _slot_mapping_kernel(num_tokens, max_num_tokens, query_start_loc_ptr, positions_ptr, block_table_ptr,
                         block_table_stride, slot_mapping_ptr, BLOCK_SIZE: tl.constexpr, PAD_ID: tl.constexpr,
                         TILE: tl.constexpr):
    req = tl.program_id(0)
    if req == tl.num_programs(0) - 1:
        # The last program pads the tail so that a padded batch never writes.
        for i in range(num_tokens, max_num_tokens, TILE):
            offsets = i + tl.arange(0, TILE)
            tl.store(slot_mapping_ptr + offsets, PAD_ID, mask=offsets < max_num_tokens)
        return
    start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    end = tl.load(query_start_loc_ptr + req + 1).to(tl.int64)
    row = req.to(tl.int64) * block_table_stride  # one row offset per request
    for i in range(start, end, TILE):
        offsets = i + tl.arange(0, TILE)
        mask = offsets < end
        pos = tl.load(positions_ptr + offsets, mask=mask, other=0).to(tl.int64)
        block = tl.load(block_table_ptr + row + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
        tl.store(slot_mapping_ptr + offsets, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)


def slot_mapping_triton(query_start_loc: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                        block_size: int, num_tokens: int, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (int64, ``max_num_tokens`` long) with the batch's slots; one program per request."""
    num_reqs = query_start_loc.numel() - 1
    _slot_mapping_kernel[(num_reqs + 1,)](num_tokens, out.numel(), query_start_loc, positions, block_table,
                                          block_table.stride(0), out, BLOCK_SIZE=block_size, PAD_ID=PAD_SLOT_ID,
                                          TILE=TILE)
    return out


def slot_mapping_torch(query_start_loc: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, num_tokens: int, out: torch.Tensor) -> torch.Tensor:
    """The torch twin of ``slot_mapping_triton``: the same int64 result, bit for bit."""
    counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                   output_size=num_tokens)
    pos = positions[:num_tokens].long()
    blocks = block_table[rows, pos // block_size].long()
    out[:num_tokens] = blocks * block_size + pos % block_size
    out[num_tokens:] = PAD_SLOT_ID
    return out
