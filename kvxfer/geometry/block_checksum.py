"""The one block checksum kvxfer uses everywhere.

Definition (so that any node can verify what another stored):

- input: the block's bytes as the tier stores them, which is the block's byte
  runs in the pool (``PoolLayout.block_runs``) concatenated in ascending offset
  order; for block-major layouts, simply the block's one span
- pieces: that input cut into pieces of ``PIECE_BYTES`` (64 KiB), the last one
  shorter (an empty input is one empty piece)
- value: XXH3-64 (``XXH3_64bits_withSeed``, xxHash 0.8, seed 0) of the pieces'
  XXH3-64 values (seed 0), each as 8 bytes little-endian, in order; when
  serialised, 8 bytes little-endian

Why pieces: XXH3 folds a span's 1 KiB steps in sequence, so one GPU program hashes one
span, and a 2 MiB block took about 0.8 ms against about 40 us to copy it (H200); each
piece is a program of its own, and the host computes the same value (``FORMAT`` names
it; the block format's fingerprint covers it, so blocks of another checksum format are
never served or exchanged). Namespaces bind the layout, so two pools that order a
block's bytes differently never share keys.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np
import xxhash

FORMAT = "xxh3-64 of xxh3-64 of 64 KiB pieces"
PIECE_BYTES = 64 << 10
SEED = 0
_digest = xxhash.xxh3_64_intdigest


def combine(piece_sums: list[int]) -> int:
    """The block checksum from its pieces' XXH3-64 values, in order."""
    return _digest(struct.pack(f"<{len(piece_sums)}Q", *piece_sums), SEED)


def combine_rows(piece_sums: np.ndarray, blocks: int) -> list[int]:
    """``combine`` of each of ``blocks`` equal rows of piece sums (block after block, pieces in order)."""
    rows = np.ascontiguousarray(piece_sums, dtype="<u8").reshape(blocks, -1)
    return [_digest(row, SEED) for row in rows]


def block_checksum(data, piece: int = PIECE_BYTES) -> int:
    """The checksum of one block's bytes; ``data`` is any C-contiguous buffer."""
    view = memoryview(data).cast("B")
    n = len(view)
    if n <= piece:  # (also an empty block: one empty piece)
        return combine([_digest(view, SEED)])
    return combine([_digest(view[a:a + piece], SEED) for a in range(0, n, piece)])


def rows_checksums(rows: Iterable) -> list[int]:
    """The checksum of each C-contiguous row (one block per row)."""
    return [block_checksum(row) for row in rows]


def runs_checksum(runs: Iterable, piece: int = PIECE_BYTES) -> int:
    """The checksum of several buffers taken as one (a block's runs, in order): pieces may span runs."""
    sums: list[int] = []
    state, filled = xxhash.xxh3_64(seed=SEED), 0
    for run in runs:
        view = memoryview(run).cast("B")
        at = 0
        while at < len(view):
            take = min(piece - filled, len(view) - at)
            state.update(view[at:at + take])
            at, filled = at + take, filled + take
            if filled == piece:
                sums.append(state.intdigest())
                state.reset()
                filled = 0
    if filled or not sums:
        sums.append(state.intdigest())
    return combine(sums)
