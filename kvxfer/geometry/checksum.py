"""The one block checksum kvxfer uses everywhere.

Definition (so that any node can verify what another stored):

- algorithm: XXH3, 64-bit variant (``XXH3_64bits_withSeed``), xxHash 0.8
- seed: 0
- input: the block's bytes as the tier stores them, which is the block's byte
  runs in the pool (``PoolLayout.block_runs``) concatenated in ascending offset
  order; for block-major layouts, simply the block's one span
- value: the unsigned 64-bit result; when serialised, 8 bytes little-endian

Namespaces bind the layout, so two pools that order a block's bytes differently
never share keys.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

ALGORITHM = "xxh3-64"
SEED = 0


def block_checksum(data) -> int:
    """XXH3-64 (seed 0) of one block's bytes; ``data`` is any C-contiguous buffer."""
    return xxhash.xxh3_64_intdigest(data, SEED)


def rows_checksums(rows: Iterable[np.ndarray]) -> list[int]:
    """The checksum of each C-contiguous uint8 row (one block per row)."""
    digest = xxhash.xxh3_64_intdigest
    return [digest(row, SEED) for row in rows]


def runs_checksum(runs: Iterable[np.ndarray]) -> int:
    """The checksum of several buffers taken as one (a block's runs, in order)."""
    state = xxhash.xxh3_64(seed=SEED)
    for run in runs:
        state.update(run)
    return state.intdigest()
