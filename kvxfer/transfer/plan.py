"""Copy plans: a batch of (pool block -> tier slot) pairs as coalesced byte descriptors.

Pure arithmetic over the layout (numpy, no tensors moved). A block is
``runs_per_block`` runs of ``run_length`` bytes; run ``o`` of block ``b`` lies at
pool offset ``outer[o] + b * run_length``; a tier slot holds a block's runs back to
back. Descriptors are sorted by pool offset; adjacent ones that are contiguous on
both sides are merged.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.core.slots import slot_array
from kvxfer.geometry.layout import Axis, PoolLayout

#: A canonical block's axes, outermost first (its order; B is outside).
_CANONICAL_AXES = (Axis.L, Axis.H, Axis.N, Axis.KV, Axis.D)


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
    return _merged(pool, tier, run)


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


def _piece_index(layout: PoolLayout, canonical: PoolLayout) -> tuple[tuple[Axis, ...], np.ndarray, int]:
    """The axes outside a rank's pieces, the index of each piece over them, and the pieces' length."""
    spec, axes = layout.spec, _CANONICAL_AXES
    length, inner = spec.element_size, len(axes)
    while inner > 0:
        axis = axes[inner - 1]
        if spec.axis_size(axis) > 1 and (layout.strides[axis] != length or canonical.strides[axis] != length):
            break
        length *= spec.axis_size(axis)
        inner -= 1
    outer = axes[:inner]
    index = np.array(list(itertools.product(*(range(spec.axis_size(a)) for a in outer))), dtype=np.int64)
    index = index.reshape(-1, len(outer)) if outer else np.zeros((1, 0), dtype=np.int64)  # (one piece: the block)
    return outer, index, length


def _at(index: np.ndarray, outer: tuple[Axis, ...], strides: dict[Axis, int]) -> np.ndarray:
    return index @ np.array([strides[a] for a in outer], dtype=np.int64)


def shard_pieces(layout: PoolLayout, canonical: PoolLayout, first_head: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A tensor-parallel rank's block as pieces contiguous in both its pool and a canonical slot: their
    offsets in block 0 of the pool, their offsets in a slot, and their common length. A piece grows from
    D outwards over the axes L, H, N, KV, D for as long as both sides keep them contiguous (BLHNC: one
    piece a layer; flash_attn: one a head vector)."""
    outer, index, length = _piece_index(layout, canonical)
    return (_at(index, outer, layout.strides),
            _at(index, outer, canonical.strides) + first_head * canonical.strides[Axis.H], length)


def shard_rows(layout: PoolLayout, canonical: PoolLayout, first_head: int
               ) -> tuple[np.ndarray, np.ndarray, int, tuple[np.ndarray, np.ndarray, int]]:
    """For staging a rank's block as one row in the canonical order of its heads (L, its H, N, KV, D): the
    pieces' pool offsets (block 0), their offsets in the row, their length; and the row's layer slices,
    as (offsets in the row, offsets in a canonical slot, length)."""
    spec = layout.spec
    outer, index, length = _piece_index(layout, canonical)
    row_strides, step = {}, spec.element_size
    for axis in reversed(_CANONICAL_AXES):
        row_strides[axis] = step
        step *= spec.axis_size(axis)
    layers = np.arange(spec.num_layers, dtype=np.int64)
    size = row_strides[Axis.L]  # one layer of the rank's heads
    slices = (layers * size, layers * canonical.strides[Axis.L] + first_head * canonical.strides[Axis.H], size)
    return _at(index, outer, layout.strides), _at(index, outer, row_strides), length, slices


def plan_shard_copies(layout: PoolLayout, pieces: tuple[np.ndarray, np.ndarray, int], slot_bytes: int,
                      blocks: list[int], slots: Sequence[int]) -> CopyPlan:
    """Descriptors moving a rank's part of each pool block ``blocks[i]`` to/from its place in the
    canonical block of tier slot ``slots[i]`` (``pieces``: ``shard_pieces``)."""
    offsets, places, length = pieces
    b = np.asarray(blocks, dtype=np.int64)
    s = slot_array(slots)
    pool = (b[:, None] * layout.strides[Axis.B] + offsets[None, :]).ravel()
    tier = (s[:, None] * slot_bytes + places[None, :]).ravel()
    return _merged(pool, tier, length)


def _merged(pool: np.ndarray, tier: np.ndarray, run: int) -> CopyPlan:
    """Runs of ``run`` bytes sorted by pool offset, those contiguous on both sides merged."""
    order = np.argsort(pool, kind="stable")
    pool, tier = pool[order], tier[order]
    if len(pool) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return CopyPlan(empty, empty, empty)
    # A descriptor starts wherever either side stops being contiguous with the previous run.
    starts = np.concatenate(([0], np.nonzero((pool[1:] != pool[:-1] + run) | (tier[1:] != tier[:-1] + run))[0] + 1))
    lengths = np.diff(np.concatenate((starts, [len(pool)]))) * run
    return CopyPlan(pool[starts], tier[starts], lengths)
