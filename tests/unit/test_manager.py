"""PoolManager over a real shared-memory pool: outcomes, integrity, refusal of bad batches."""

import pytest
import torch

from kvxfer.core.errors import Internal, InvalidArgument
from kvxfer.core.records import Outcome
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.memory.pool import Pool
from kvxfer.serving.batch import TransferBatch
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.transfer import CompletedHandle, CopyBatch, CopyEngine
from kvxfer.transfer.cpu import CpuCopyEngine
from tests.helpers import read_block

NS = "llama-test"
SPEC = KVSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)


@pytest.fixture(params=["BLHNC", "LBHNC"])
def pool(request, shm_dir):
    with Pool.create("t", SPEC, PRESETS[request.param], shm_dir=shm_dir) as p:
        p.storage.copy_(torch.randint(0, 256, (p.layout.nbytes,), dtype=torch.uint8))
        yield p


def test_roundtrip_and_already_present(pool):
    m = PoolManager(pool, 8)
    expected = {s: read_block(pool.storage, pool.layout, s) for s in (3, 4, 9)}
    assert m.offload(NS, [(3, b"k3"), (4, b"k4"), (9, b"k9")]).outcomes == [Outcome.DONE] * 3
    pool.storage.zero_()
    assert m.offload(NS, [(3, b"k3")]).outcomes == [Outcome.ALREADY_PRESENT]  # not copied again
    assert m.restore(NS, [(b"k9", 1), (b"k3", 15), (b"k4", 2)]).outcomes == [Outcome.DONE] * 3
    assert torch.equal(read_block(pool.storage, pool.layout, 1), expected[9])
    assert torch.equal(read_block(pool.storage, pool.layout, 15), expected[3])
    assert torch.equal(read_block(pool.storage, pool.layout, 2), expected[4])
    assert int(read_block(pool.storage, pool.layout, 5).count_nonzero()) == 0
    stats = m.stats()
    assert stats.offloaded.blocks == 3 and stats.offloaded.bytes == 3 * SPEC.block_bytes
    assert stats.restored.blocks == 3 and m.group.index.stats().pinned == 0


def test_checksum_mismatch_is_data_loss_and_drops_the_entry(pool):
    m = PoolManager(pool, 8)
    m.offload(NS, [(3, b"good"), (4, b"bad")])
    want_good = read_block(pool.storage, pool.layout, 3)
    bad_slot = m.group.index.locate(NS, b"bad")
    m.host.buffer[bad_slot][17] ^= 0x40  # one flipped bit in the stored copy
    pool.storage.zero_()
    assert m.restore(NS, [(b"good", 5), (b"bad", 6)]).outcomes == [Outcome.DONE, Outcome.DATA_LOSS]
    assert torch.equal(read_block(pool.storage, pool.layout, 5), want_good)
    assert m.lookup(NS, [b"good", b"bad"]).tiers[1] is None  # dropped, never served again
    assert m.restore(NS, [(b"bad", 6)]).outcomes == [Outcome.NOT_FOUND]
    assert m.group.index.stats().pinned == 0


class BrokenEngine(CopyEngine):
    """A copy engine whose hardware fails: the only fake here, for a failure we cannot cause."""

    def __init__(self, inner):
        self.inner, self.fail = inner, True

    @property
    def descriptors_per_block(self):
        return self.inner.descriptors_per_block

    def submit(self, batch: CopyBatch):
        return CompletedHandle(Internal("DMA error")) if self.fail else self.inner.submit(batch)

    def pool_checksums(self, blocks):
        return self.inner.pool_checksums(blocks)


def test_failed_copy_leaves_nothing_visible_and_no_pins(pool):
    m = PoolManager(pool, 4)
    m.copier.engine = BrokenEngine(CpuCopyEngine(pool.storage, pool.layout, m.host))
    assert m.offload(NS, [(1, b"a"), (2, b"b")]).outcomes == [Outcome.FAILED] * 2
    stats = m.group.index.stats()
    assert (stats.used, stats.pinned, stats.ready) == (0, 0, 0)
    assert m.lookup(NS, [b"a"]).hits == 0
    m.copier.engine.fail = False
    assert m.offload(NS, [(1, b"a")]).outcomes == [Outcome.DONE]
    m.copier.engine.fail = True
    assert m.restore(NS, [(b"a", 3)]).outcomes == [Outcome.FAILED]
    assert m.group.index.stats().pinned == 0 and m.lookup(NS, [b"a"]).hits == 1


def test_capacity_exhausted_and_eviction(pool):
    m = PoolManager(pool, 2)
    assert m.offload(NS, [(1, b"a"), (2, b"b"), (3, b"c")]).outcomes == [Outcome.DONE, Outcome.DONE,
                                                                Outcome.RESOURCE_EXHAUSTED]
    assert m.offload(NS, [(3, b"c")]).outcomes == [Outcome.DONE]  # evicts a, the least recently used
    assert m.lookup(NS, [b"a", b"b", b"c"]).tiers == [None, m.group.index.tier, m.group.index.tier]


BAD_OFFLOADS = {
    "null block": [(0, b"a")],
    "slot out of range": [(16, b"a")],
    "negative slot": [(-1, b"a")],
    "duplicate slots": [(1, b"a"), (1, b"b")],
    "duplicate keys": [(1, b"a"), (2, b"a")],
    "empty key": [(1, b"")],
    "oversized key": [(1, b"x" * 257)],
    "one bad among good": [(1, b"a"), (2, b"b"), (0, b"c")],
}


@pytest.mark.parametrize("case", BAD_OFFLOADS)
def test_malformed_batches_are_refused_whole(pool, case):
    m = PoolManager(pool, 4)
    m.offload(NS, [(5, b"kept")])
    before_pool, before_host = pool.storage.clone(), m.host.buffer.clone()
    with pytest.raises(InvalidArgument):
        m.offload(NS, BAD_OFFLOADS[case])
    with pytest.raises(InvalidArgument):
        m.restore(NS, [(k, s) for s, k in BAD_OFFLOADS[case]])
    assert torch.equal(pool.storage, before_pool) and torch.equal(m.host.buffer, before_host)
    stats = m.group.index.stats()
    assert (stats.used, stats.ready, stats.pinned) == (1, 1, 0)


@pytest.mark.parametrize("namespace", ["", "-lead", "a" * 129, "sp ace", "new\nline"])
def test_bad_namespace(pool, namespace):
    m = PoolManager(pool, 4)
    for call in (lambda: m.offload(namespace, [(1, b"a")]), lambda: m.lookup(namespace, [b"a"]),
                 lambda: m.delete(namespace, [b"a"]), lambda: m.restore(namespace, [(b"a", 1)])):
        with pytest.raises(InvalidArgument):
            call()


def test_odd_sized_runs_move_exactly(shm_dir):
    spec = KVSpec(num_layers=2, num_blocks=6, block_size=3, num_kv_heads=1, head_size=3, dtype=torch.float8_e4m3fn)
    for name in ("BLHNC", "flash_attn"):  # 36-byte span, 9-byte runs
        with Pool.create("odd", spec, PRESETS[name], shm_dir=shm_dir) as pool:
            m = PoolManager(pool, 4)
            pool.storage.copy_(torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8))
            want = read_block(pool.storage, pool.layout, 2)
            m.offload(NS, [(2, b"x")])
            assert m.restore(NS, [(b"x", 4)]).outcomes == [Outcome.DONE]
            assert torch.equal(read_block(pool.storage, PoolLayout(spec, PRESETS[name]), 4), want)


def test_pool_checksums_match_tier_checksums(pool):
    """The pool-side hash of a block equals the hash of its tier copy, in every layout."""
    m = PoolManager(pool, 4)
    m.offload(NS, [(7, b"k"), (2, b"j")])
    slots = [m.group.index.locate(NS, b"k"), m.group.index.locate(NS, b"j")]
    assert m.engine.pool_checksums([7, 2]) == m.host.checksums(slots)


class Clock:
    """time.monotonic() and perf_counter() that only the copies move."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


class Ticking(CopyEngine):
    """The CPU engine, each batch taking one second of ``clock``."""

    def __init__(self, inner: CopyEngine, clock: Clock) -> None:
        self.inner, self.clock = inner, clock

    @property
    def descriptors_per_block(self) -> int:
        return self.inner.descriptors_per_block

    @property
    def hashes_copies(self) -> bool:
        return self.inner.hashes_copies

    def submit(self, batch: CopyBatch):
        handle = self.inner.submit(batch)
        self.clock.now += 1.0
        return handle

    def pool_checksums(self, blocks):
        return self.inner.pool_checksums(blocks)


def test_the_engines_deadline_stops_copies_and_what_landed_after_it_never_counts(pool, monkeypatch):
    from kvxfer.serving import pool_manager as manager_module
    from kvxfer.transfer import pipeline
    from kvxfer.transfer.pipeline import CheckedCopier

    clock = Clock()
    monkeypatch.setattr(pipeline, "time", clock)
    monkeypatch.setattr(manager_module, "time", clock)
    m = PoolManager(pool, 16)
    m.engine = Ticking(m.engine, clock)
    m.copier = CheckedCopier(m.engine, m.host, chunk_bytes=2 * pool.layout.block_bytes)  # 2 blocks a chunk
    keys = [b"k%d" % i for i in range(6)]
    # Chunk 1 lands at 101 (in time), chunk 2 starts at 101 and lands at 102 (late), chunk 3 never starts.
    done = m.run(TransferBatch.offload(NS, list(zip(range(1, 7), keys)), SPEC.num_blocks, deadline=101.5))
    assert done.outcomes == [Outcome.DONE] * 2 + [Outcome.DEADLINE_EXCEEDED] * 4
    assert m.lookup(NS, keys).hits == 2 and m.group.index.stats().pinned == 0
    assert m.group.index.stats().used == 2  # the late blocks' slots were released, never published

    before = pool.storage.clone()
    late = m.run(TransferBatch.restore(NS, [(keys[0], 9), (keys[1], 10)], SPEC.num_blocks, deadline=clock.now - 1))
    assert late.outcomes == [Outcome.DEADLINE_EXCEEDED] * 2 and torch.equal(pool.storage, before)  # untouched
    m.copier = CheckedCopier(m.engine, m.host, chunk_bytes=pool.layout.block_bytes)  # 1 block a chunk
    half = m.run(TransferBatch.restore(NS, [(keys[0], 9), (keys[1], 10)], SPEC.num_blocks, deadline=clock.now + 1.5))
    assert half.outcomes == [Outcome.DONE, Outcome.DEADLINE_EXCEEDED]  # the second landed after the deadline
    assert torch.equal(read_block(pool.storage, pool.layout, 9), read_block(before, pool.layout, 1))
    assert m.group.index.stats().pinned == 0 and m.lookup(NS, keys[:2]).hits == 2  # entries stay; only the copy was late
