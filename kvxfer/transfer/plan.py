"""Copy plans: a batch of (pool block -> tier slot) pairs as coalesced byte descriptors.

Pure arithmetic over the layout (numpy, no tensors moved). A block is
``runs_per_block`` runs of ``run_length`` bytes; run ``o`` of block ``b`` lies at
pool offset ``outer[o] + b * run_length``; a tier slot holds a block's runs back to
back. Descriptors are sorted by pool offset; adjacent ones that are contiguous on
both sides are merged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.geometry.layout import PoolLayout
from kvxfer.tiers.slots import slot_array


@dataclass(frozen=True)
class CopyPlan:
    """Parallel arrays, one row per descriptor: ``nbytes`` bytes between pool offset
    ``pool_offsets[i]`` and tier offset ``tier_offsets[i]``."""

    pool_offsets: np.ndarray
    tier_offsets: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


def plan_copies(layout: PoolLayout, blocks: list[int], slots: Sequence[int]) -> CopyPlan:
    """Descriptors moving each pool block ``blocks[i]`` to/from tier slot ``slots[i]``."""
    run = layout.run_length
    outer = np.asarray(layout._outer_offsets, dtype=np.int64)
    b = np.asarray(blocks, dtype=np.int64)
    s = slot_array(slots)
    pool = (b[:, None] * run + outer[None, :]).ravel()
    tier = (s[:, None] * layout.block_bytes + np.arange(len(outer), dtype=np.int64)[None, :] * run).ravel()
    order = np.argsort(pool, kind="stable")
    pool, tier = pool[order], tier[order]
    if len(pool) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return CopyPlan(empty, empty, empty)
    # A descriptor starts wherever either side stops being contiguous with the previous run.
    starts = np.concatenate(([0], np.nonzero((pool[1:] != pool[:-1] + run) | (tier[1:] != tier[:-1] + run))[0] + 1))
    lengths = np.diff(np.concatenate((starts, [len(pool)]))) * run
    return CopyPlan(pool[starts], tier[starts], lengths)


def file_calls(plan: CopyPlan, max_iov: int = 1024) -> list[tuple[int, list[tuple[int, int]]]]:
    """Group descriptors into vectored file calls: (pool offset, [(tier offset, nbytes), ...]).

    One call covers a range contiguous on the pool side, scattered on the tier side,
    of at most ``max_iov`` pieces (the kernel's IOV_MAX).
    """
    calls: list[tuple[int, list[tuple[int, int]]]] = []
    end = -1
    for p, t, n in zip(plan.pool_offsets.tolist(), plan.tier_offsets.tolist(), plan.nbytes.tolist()):
        if p == end and len(calls[-1][1]) < max_iov:
            calls[-1][1].append((t, n))
        else:
            calls.append((p, [(t, n)]))
        end = p + n
    return calls
