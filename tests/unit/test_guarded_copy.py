"""Guarded copies: a pool mapped from a file its owner may shrink (SGLang's memfd has no seals).

The C loop's SIGBUS handler turns a copy that faults on a shrunk file into a failed batch and a pool
broken for good; a fault anywhere else still ends the process as it would have. The cases that could
crash run in a child process, so that a crash is a failed test, not a lost session."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from kvxfer.core.records import Medium
from kvxfer.geometry.layout import PRESETS, KVSpec, Layout, PoolLayout
from kvxfer.memory.pool import Access, Pool, PoolDescriptor, PoolHandle
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import CopyBatch, Direction, engine_for, native
from tests.helpers import read_block

SPEC = KVSpec(2, 64, 4, 2, 64, torch.float16)


def guarded_pool(layout: str = "BLHNC", spec: KVSpec = SPEC, offset: int = 0) -> tuple[Pool, int]:
    """A pool in a memfd without seals (as SGLang allocates one), at ``offset`` in it."""
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, offset + PoolLayout(spec, PRESETS[layout]).nbytes)
    own = os.dup(fd)
    descriptor = PoolDescriptor("p", spec, Layout.parse(layout), PoolHandle(Medium.SHM, offset=offset))
    return Pool.from_fd(descriptor, fd, guarded=True), own


@pytest.mark.parametrize("layout, offset", [("BLHNC", 0), ("LBHNC", 0), ("BLHNC", 4096 + 512)])
def test_a_guarded_pool_copies_bit_exact_through_the_c_loop(layout, offset):
    pool, own = guarded_pool(layout, offset=offset)
    host = HostTier(16, pool.layout.block_bytes)
    engine = engine_for(pool, host)
    assert pool.access is Access.GUARDED and "guarded" in engine.describe()
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8))
    sums = engine.submit(CopyBatch(Direction.TO_HOST, [3, 9, 4], [0, 5, 1])).wait()
    assert sums == host.checksums([0, 5, 1]) == engine.pool_checksums([3, 9, 4])
    assert engine.submit(CopyBatch(Direction.TO_POOL, [20, 21, 22], [0, 5, 1])).wait() == sums
    for a, b in ((3, 20), (9, 21), (4, 22)):
        assert torch.equal(read_block(pool.storage, pool.layout, a), read_block(pool.storage, pool.layout, b))
    pool.close()
    os.close(own)


def test_a_shrunk_file_fails_every_copy_for_good_and_nothing_else():
    pool, own = guarded_pool()
    other, other_fd = guarded_pool()
    host = HostTier(16, pool.layout.block_bytes)
    engine, bystander = engine_for(pool, host), engine_for(other, HostTier(16, pool.layout.block_bytes))
    engine.submit(CopyBatch(Direction.TO_HOST, [1], [0])).wait()
    os.ftruncate(own, 0)  # what SGLang, or anyone holding the descriptor, may do
    for direction in (Direction.TO_HOST, Direction.TO_POOL):
        with pytest.raises(native.PoolShrunk, match="shrunk"):
            engine.submit(CopyBatch(direction, [2, 3], [1, 2])).wait()
    os.ftruncate(own, pool.layout.nbytes)  # grown back: the mapping is still gone, the pool still broken
    with pytest.raises(native.PoolShrunk):
        engine.submit(CopyBatch(Direction.TO_HOST, [2], [1])).wait()
    with pytest.raises(native.PoolShrunk):
        engine.pool_checksums([2])
    assert bystander.submit(CopyBatch(Direction.TO_HOST, [2], [1])).wait()  # another pool copies on
    for p, fd in ((pool, own), (other, other_fd)):
        p.close()
        os.close(fd)


def _child(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent('''
        import os, threading, time
        import torch
        from tests.unit.test_guarded_copy import guarded_pool
        from kvxfer.tiers.host import HostTier
        from kvxfer.transfer import CopyBatch, Direction, engine_for, native
    ''') + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_a_file_shrunk_in_the_middle_of_copies_on_every_thread_fails_them_and_the_process_lives():
    """Copies of 8 MiB batches on the caller and two helper threads, both ways, while the owner shrinks the
    file: each batch either completes before the shrink or raises; none crashes the process."""
    child = _child('''
        from kvxfer.geometry.layout import KVSpec
        spec = KVSpec(4, 256, 8, 16, 64, torch.float16)  # 128 KiB blocks, 32 MiB
        for round in range(6):
            pool, own = guarded_pool(spec=spec)
            engine = engine_for(pool, HostTier(64, pool.layout.block_bytes), threads=3)
            engine._step = 1  # one block a step: the helpers copy too
            shrink = threading.Timer(0.002 * round, os.ftruncate, (own, 4096 * round))
            shrink.start()
            outcomes = []
            for i in range(200):
                direction = (Direction.TO_HOST, Direction.TO_POOL)[i % 2]
                try:
                    engine.submit(CopyBatch(direction, list(range(1, 65)), list(range(64)))).wait()
                    outcomes.append("done")
                except native.PoolShrunk:
                    outcomes.append("shrunk")
            shrink.join()
            assert outcomes[-1] == "shrunk" and "done" not in outcomes[outcomes.index("shrunk"):], outcomes
            pool.close()
            os.close(own)
        print("alive")
    ''')
    assert child.returncode == 0 and "alive" in child.stdout, child.stderr[-3000:]


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_fault_outside_a_guarded_copy_still_ends_the_process(faulthandler):
    """The handler passes every other SIGBUS on: to Python's faulthandler where it was enabled first, else
    to the default action (the process dies of SIGBUS), as if it were not installed."""
    child = _child(f'''
        import faulthandler, mmap
        if {faulthandler}:
            faulthandler.enable()
        pool, own = guarded_pool()
        engine_for(pool, HostTier(4, pool.layout.block_bytes)).submit(CopyBatch(Direction.TO_HOST, [1], [0])).wait()
        fd = os.memfd_create("other")
        os.ftruncate(fd, 1 << 16)
        view = mmap.mmap(fd, 1 << 16)
        os.ftruncate(fd, 0)
        print("read", view[40000], flush=True)  # not a guarded copy: SIGBUS
        print("alive")
    ''')
    assert child.returncode == -signal.SIGBUS and "alive" not in child.stdout, (child.returncode, child.stderr)
    if faulthandler:
        assert "Bus error" in child.stderr
