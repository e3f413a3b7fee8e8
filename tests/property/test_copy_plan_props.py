"""Copy plans and the descriptor copy engine, for every layout: each tier byte written once,
within bounds, with exactly the block's runs; byte-equal to the mapped CPU engine."""

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.geometry.layout import PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import CopyBatch, Direction, FdCopyEngine
from kvxfer.transfer.cpu import CpuCopyEngine
from kvxfer.transfer.host_plan import HostPlanEngine
from kvxfer.transfer.plan import file_calls, plan_copies
from tests.strategies import layouts, specs


def batches(num_blocks: int, capacity: int):
    """Distinct pool blocks (never 0) paired with distinct tier slots."""
    return st.integers(0, min(num_blocks - 1, capacity)).flatmap(lambda n: st.tuples(
        st.permutations(range(1, num_blocks)).map(lambda p: list(p[:n])),
        st.permutations(range(capacity)).map(lambda p: list(p[:n]))))


@settings(max_examples=150, deadline=None)
@given(specs(), layouts(), st.data())
def test_plan_writes_each_tier_byte_of_the_batch_once_from_the_right_run(spec, layout, data):
    pl = PoolLayout(spec, layout)
    capacity = spec.num_blocks + 2
    blocks, slots = data.draw(batches(spec.num_blocks, capacity))
    plan = plan_copies(pl, blocks, slots)
    written = np.zeros(capacity * pl.block_bytes, dtype=np.int64)
    source = np.full(capacity * pl.block_bytes, -1, dtype=np.int64)
    for p, t, n in zip(plan.pool_offsets, plan.tier_offsets, plan.nbytes):
        assert 0 <= p and p + n <= pl.nbytes and 0 <= t and t + n <= len(written)
        written[t:t + n] += 1
        source[t:t + n] = np.arange(p, p + n)
    expected = np.zeros_like(written)
    for b, s in zip(blocks, slots):
        expected[s * pl.block_bytes:(s + 1) * pl.block_bytes] = 1
        runs = np.concatenate([np.arange(r.offset, r.end) for r in pl.block_runs(b)])
        assert np.array_equal(source[s * pl.block_bytes:(s + 1) * pl.block_bytes], runs)
    assert np.array_equal(written, expected)
    assert plan.total_bytes == len(blocks) * pl.block_bytes
    assert len(plan) <= len(blocks) * pl.runs_per_block
    if pl.runs_per_block == 1 and blocks and slots == list(range(slots[0], slots[0] + len(slots))) and \
            blocks == list(range(blocks[0], blocks[0] + len(blocks))):
        assert len(plan) == 1  # consecutive blocks into consecutive slots: one descriptor
    calls = file_calls(plan, max_iov=3)
    assert sum(len(pieces) for _, pieces in calls) == len(plan) and all(len(p) <= 3 for _, p in calls)


@settings(max_examples=60, deadline=None)
@given(specs(), layouts(), st.data())
def test_descriptor_engine_moves_the_same_bytes_as_the_mapped_engine(spec, layout, data):
    pl = PoolLayout(spec, layout)
    capacity = spec.num_blocks
    blocks, slots = data.draw(batches(spec.num_blocks, capacity))
    g = torch.Generator().manual_seed(len(blocks))
    content = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=g)
    path = Path(tempfile.mkdtemp(dir="/dev/shm")) / "pool"
    offset = data.draw(st.sampled_from([0, 8, 4096]))
    path.write_bytes(bytes(offset) + content.numpy().tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        mapped_host, fd_host = HostTier(capacity, pl.block_bytes), HostTier(capacity, pl.block_bytes)
        pool = content.clone()
        CpuCopyEngine(pool, pl, mapped_host).submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
        FdCopyEngine(fd, offset, pl, fd_host).submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
        assert torch.equal(mapped_host.buffer, fd_host.buffer)
        back = list(reversed(blocks))  # restore into other blocks
        CpuCopyEngine(pool, pl, mapped_host).submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
        FdCopyEngine(fd, offset, pl, fd_host).submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
        on_disk = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        assert bytes(on_disk[:offset]) == bytes(offset)
        assert np.array_equal(on_disk[offset:], pool.numpy())
        assert FdCopyEngine(fd, offset, pl, fd_host).pool_checksums(back) == \
            CpuCopyEngine(pool, pl, mapped_host).pool_checksums(back)
    finally:
        os.close(fd)
        shutil.rmtree(path.parent)


@settings(max_examples=80, deadline=None)
@given(spec=specs(), layout=layouts(), data=st.data())
def test_the_host_plan_executor_equals_the_gather_engine(spec, layout, data):
    pl = PoolLayout(spec, layout)
    blocks, slots = data.draw(batches(spec.num_blocks, spec.num_blocks))
    content = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    gathered, planned = content.clone(), content.clone()
    gather_host, plan_host = HostTier(spec.num_blocks, pl.block_bytes), HostTier(spec.num_blocks, pl.block_bytes)
    CpuCopyEngine(gathered, pl, gather_host).submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    HostPlanEngine(planned, pl, plan_host).submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    assert torch.equal(gather_host.buffer, plan_host.buffer)
    back = list(reversed(blocks))
    CpuCopyEngine(gathered, pl, gather_host).submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
    HostPlanEngine(planned, pl, plan_host).submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
    assert torch.equal(gathered, planned)
