"""The C loop's streamed batches (kvxfer/transfer/_fused.c: a batch of at least
``stream_min_bytes`` is stored past the cache and each piece hashed from the side just read):
the same bytes and the same checksums as the checksum's definition, for rows of any size against
the pieces (one row cut into pieces, rows under a piece, rows across piece boundaries, unaligned
rows), both directions, one thread or several; batches under the threshold, or of rows under a piece,
take the cached path."""

import copy
import platform

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import CopyBatch, Direction, native
from kvxfer.transfer.cpu import CpuCopyEngine
from tests.helpers import read_block

PIECES = (4096, 64 << 10)


def test_streamed_where_the_cpu_has_stream_stores():
    copier = native.load()
    if platform.machine() in ("x86_64", "AMD64"):
        assert copier.stream_min_bytes == 4 << 20
    else:
        assert copier.stream_min_bytes == np.iinfo(np.int64).max


@settings(max_examples=25, deadline=None)
@given(rows_per_block=st.integers(1, 4), row_bytes=st.integers(1000, 200_000), piece=st.sampled_from(PIECES),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 1 << 16), data=st.data())
def test_a_streamed_batch_copies_and_hashes_as_the_checksum_says(rows_per_block, row_bytes, piece, threads, seed,
                                                                  data):
    copier = copy.copy(native.load())
    copier._piece = piece  # the checksum's pieces, smaller here: more of them straddle rows
    span = rows_per_block * row_bytes
    if span <= piece:
        row_bytes, span = piece + 17, rows_per_block * (piece + 17)
    blocks = -(-copier.stream_min_bytes // span) + data.draw(st.integers(0, 3)) \
        if copier.stream_min_bytes < 1 << 40 else 8
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, (blocks * rows_per_block + 5, row_bytes), dtype=np.uint8)
    tier = np.zeros((blocks + 3) * rows_per_block * row_bytes, dtype=np.uint8)
    tier_rows, slots_view = tier.reshape(-1, row_bytes), tier.reshape(blocks + 3, span)
    slots = rng.permutation(blocks + 3)[:blocks].astype(np.int64)
    pool_rows = rng.permutation(len(pool))[:blocks * rows_per_block].astype(np.int64)
    dst_rows = (slots[:, None] * rows_per_block + np.arange(rows_per_block)[None, :]).reshape(-1)
    step = data.draw(st.integers(1, blocks))
    # an offload: pool rows into tier slots, hashed on the tier side (the destination)
    sums = copier.copy_hash(tier_rows, pool, dst_rows, pool_rows, slots_view, slots, step, threads)
    expected = [block_checksum(pool[pool_rows[b * rows_per_block:(b + 1) * rows_per_block]].reshape(-1), piece)
                for b in range(blocks)]
    assert sums == expected
    assert all((slots_view[s] == pool[pool_rows[b * rows_per_block:(b + 1) * rows_per_block]].reshape(-1)).all()
               for b, s in enumerate(slots))
    # a restore: the tier slots into other pool rows, hashed on the tier side (the source)
    back = np.zeros_like(pool)
    assert copier.copy_hash(back, tier_rows, pool_rows, dst_rows, slots_view, slots, step, threads) == expected
    assert (back[pool_rows] == pool[pool_rows]).all()


@pytest.mark.parametrize("layout, spec", [
    ("BLHNC", KVSpec(4, 26, 4, 4, 400, torch.float32)),  # one row of 200 KiB: three pieces and a part
    ("LBHNC", KVSpec(2, 26, 4, 4, 768, torch.float32)),  # 2 rows of 96 KiB: a piece across the two
    ("LBHNC", KVSpec(4, 10, 4, 4, 1600, torch.float32)),  # 4 rows of 200 KiB
    ("LBHNC", KVSpec(2, 34, 4, 1, 2049, torch.float32)),  # 2 rows of 65,568 bytes: unaligned rows
    ("LBHNC", KVSpec(4, 26, 4, 4, 400, torch.float32)),  # 4 rows of 50 KiB (under a piece: cached)
])
def test_the_engines_large_batches_are_the_bytes_and_checksums_of_small_ones(layout, spec):
    """Through the CPU engine: a batch over the threshold (streamed) and the same blocks one at a time
    (cached) give the same checksums and bytes, both ways; the restore lands what was offloaded."""
    pl = PoolLayout(spec, PRESETS[layout])
    pages = spec.num_blocks - 2
    pool = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(pages))
    host = HostTier(2 * pages, pl.block_bytes)
    engine = CpuCopyEngine(pool, pl, host, threads=2)
    blocks = list(range(1, pages + 1))
    assert pages * pl.block_bytes >= native.load().stream_min_bytes or native.load().stream_min_bytes > 1 << 40
    copier, before = native.load(), native.load().streamed_batches()
    streamed = engine.submit(CopyBatch(Direction.TO_HOST, blocks, list(range(0, 2 * pages, 2)))).wait()
    rows = engine._outer  # rows a block: a row of a piece or more streams
    expect = int(copier.stream_min_bytes < 1 << 40 and (rows == 1 or pl.block_bytes // rows >= 64 << 10))
    assert copier.streamed_batches() - before == expect
    one_by_one = [engine.submit(CopyBatch(Direction.TO_HOST, [b], [2 * i + 1])).wait()[0] for i, b in enumerate(blocks)]
    assert streamed == one_by_one == [block_checksum(read_block(pool, pl, b).numpy()) for b in blocks]
    originals = [read_block(pool, pl, b).clone() for b in blocks]
    pool.zero_()
    assert engine.submit(CopyBatch(Direction.TO_POOL, blocks, list(range(0, 2 * pages, 2)))).wait() == streamed
    assert copier.streamed_batches() - before == 2 * expect
    assert all(torch.equal(read_block(pool, pl, b), o) for b, o in zip(blocks, originals))
