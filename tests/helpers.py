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


def made_and_closed(factory):
    """A fixture's body: yields a maker of ``factory(...)`` objects, each closed after the test."""
    made = []

    def make(*args, **kwargs):
        thing = factory(*args, **kwargs)
        made.append(thing)
        return thing

    yield make
    for thing in made:
        thing.close()
