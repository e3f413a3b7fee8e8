"""The CPU engine's fused checksums, for every layout, in the C loop and in the numpy path: the
checksum it returns for each block is the checksum of the bytes it copied, in one step or many,
into consecutive slots or scattered."""

import itertools
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.errors import Internal
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import CopyBatch, Direction
from kvxfer.transfer.cpu import CpuCopyEngine, _Steps
from tests.helpers import read_block
from tests.strategies import layouts, specs


@settings(max_examples=120, deadline=None)
@given(specs(), layouts(), st.data())
def test_fused_checksums_are_those_of_the_bytes_copied(spec, layout, data):
    pl = PoolLayout(spec, layout)
    capacity = spec.num_blocks + 3
    n = data.draw(st.integers(1, spec.num_blocks - 1))
    blocks = data.draw(st.permutations(range(1, spec.num_blocks)))[:n]
    if data.draw(st.booleans()):  # one extent, as the allocator usually gives
        first = data.draw(st.integers(0, capacity - n))
        slots = list(range(first, first + n))
    else:
        slots = data.draw(st.permutations(range(capacity)))[:n]
    g = torch.Generator().manual_seed(n)
    pool = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=g)
    host = HostTier(capacity, pl.block_bytes)
    use_native = data.draw(st.booleans())
    engine = CpuCopyEngine(pool, pl, host, threads=data.draw(st.sampled_from([1, 2, 3])), use_native=use_native)
    assert engine.native == use_native  # the C loop is built (tests/unit/test_native_copy.py says how)
    engine._step = data.draw(st.integers(1, n + 1))  # several steps per batch (taken by several threads), or one

    sums = engine.submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    assert sums == host.checksums(slots)
    for b, s in zip(blocks, slots):
        assert torch.equal(host.buffer[s], read_block(pool, pl, b))
        assert sums[slots.index(s)] == block_checksum(read_block(pool, pl, b).numpy())

    back = data.draw(st.permutations(range(1, spec.num_blocks)))[:n]  # restore into other blocks
    before = pool.clone()
    sums_back = engine.submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
    assert sums_back == sums  # what landed equals what was stored
    assert sums_back == engine.pool_checksums(back)
    untouched = np.ones(pl.nbytes, dtype=bool)
    for b, s in zip(back, slots):
        assert torch.equal(read_block(pool, pl, b), host.buffer[s])
        for r in pl.block_runs(b):
            untouched[r.offset:r.end] = False
    assert torch.equal(pool[torch.from_numpy(untouched)], before[torch.from_numpy(untouched)])


def test_an_out_of_range_batch_is_an_error_and_moves_nothing():
    spec = KVSpec(2, 6, 4, 2, 8, torch.float16)
    for name in ("BLHNC", "LBHNC"):
        pl = PoolLayout(spec, PRESETS[name])
        pool = torch.zeros(pl.nbytes, dtype=torch.uint8)
        host = HostTier(2, pl.block_bytes)
        host.buffer.fill_(7)
        engines = (CpuCopyEngine(pool, pl, host), CpuCopyEngine(pool, pl, host, use_native=False))
        batches = (([1, spec.num_blocks], [0, 1]), ([1], [2]), ([-1], [0]), ([1], [-1]))
        for engine, (blocks, slots) in itertools.product(engines, batches):
            with pytest.raises(Internal, match="out of range"):
                engine.submit(CopyBatch(Direction.TO_POOL, blocks, slots)).wait()
        assert int(pool.sum()) == 0


def test_a_failing_step_fails_the_batch_after_every_thread_has_stopped():
    steps = _Steps(3)
    running, finished = [], []

    def step(i: int) -> list[int]:
        running.append(i)
        time.sleep(0.01)
        if i == 2:
            raise ValueError("copy failed")
        finished.append(i)
        return [i]

    with pytest.raises(ValueError, match="copy failed"):
        steps.run(9, step)
    assert len(finished) == len(running) - 1  # nothing was still copying when run() returned
    assert steps.run(4, lambda i: [i, i]) == [0, 0, 1, 1, 2, 2, 3, 3]  # in step order, the pool still usable
    assert _Steps(1).run(0, step) == []
