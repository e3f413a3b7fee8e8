"""Small helpers shared by tests: reading and writing whole blocks through their runs."""

import torch

from kvxfer.geometry.layout import PoolLayout


def read_block(storage: torch.Tensor, layout: PoolLayout, block: int) -> torch.Tensor:
    """A block's bytes in canonical order (its runs, ascending)."""
    return torch.cat([storage[r.offset:r.end] for r in layout.block_runs(block)]).clone()


def write_block(storage: torch.Tensor, layout: PoolLayout, block: int, data: torch.Tensor) -> None:
    pos = 0
    for r in layout.block_runs(block):
        storage[r.offset:r.end] = data[pos:pos + r.length]
        pos += r.length
