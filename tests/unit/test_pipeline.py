"""The checked pipeline over completion handles, eviction victims and a pluggable policy."""

import numpy as np
import torch

from kvxfer.core.records import Outcome, TierKind
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.index.block_index import BlockIndex
from kvxfer.index.eviction import EvictionPolicy
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CopyBatch, CopyEngine, CopyHandle
from kvxfer.transfer.cpu import CpuCopyEngine
from kvxfer.transfer.pipeline import CheckedCopier

SPEC = KVSpec(2, 40, 4, 2, 8, torch.float16)  # 512 B blocks


class Deferred(CopyHandle):
    def __init__(self, run, log, n):
        self.run, self.log, self.n = run, log, n

    def wait(self) -> None:
        if self.run is not None:
            self.run()
            self.run = None
            self.log.append(("landed", self.n))


class OverlappingEngine(CopyEngine):
    """A stand-in for a DMA engine: submit returns at once, the copy happens at wait()."""

    def __init__(self, inner: CopyEngine, log: list):
        self.inner, self.log, self.n = inner, log, 0

    @property
    def overlaps(self) -> bool:
        return True

    @property
    def descriptors_per_block(self) -> int:
        return self.inner.descriptors_per_block

    def submit(self, batch: CopyBatch) -> CopyHandle:
        self.n += 1
        self.log.append(("submitted", self.n))
        return Deferred(lambda: self.inner.submit(batch).wait(), self.log, self.n)

    def pool_checksums(self, blocks):
        return self.inner.pool_checksums(blocks)


def test_an_asynchronous_engine_has_the_next_chunk_in_flight_while_one_is_hashed():
    pl = PoolLayout(SPEC, PRESETS["BLHNC"])
    pool = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8)
    host = HostTier(32, pl.block_bytes)
    log: list = []
    copier = CheckedCopier(OverlappingEngine(CpuCopyEngine(pool, pl, host), log), host, chunk_bytes=4 * 512)
    blocks, slots = list(range(1, 17)), list(range(16))
    done = copier.to_host(blocks, slots)
    assert done.completed == 16 and not done.cancelled
    assert log[:3] == [("submitted", 1), ("submitted", 2), ("landed", 1)]  # chunk 2 in flight first
    assert done.checksums == host.checksums(slots)
    back = copier.to_pool(slots, done.checksums, list(range(21, 37)))
    assert back.corrupt == set() and back.completed == 16
    assert torch.equal(pool[21 * 512:37 * 512], pool[512:17 * 512])
    calls = iter([False, False, True])
    stopped = copier.to_host(blocks, slots, cancelled=lambda: next(calls))
    assert stopped.cancelled and stopped.completed == 8  # the two chunks in flight landed; no third


class MostRecentFirst(EvictionPolicy):
    def __init__(self):
        self.order = []  # slots, most recently used last

    def used(self, slots):
        for slot in slots.tolist():
            if slot in self.order:
                self.order.remove(slot)
            self.order.append(slot)

    def forget(self, slots):
        self.order = [s for s in self.order if s not in set(slots.tolist())]

    def victims(self, n, evictable):
        candidates = np.array(self.order[::-1], dtype=np.int64)
        chosen = candidates[evictable(candidates)][:n] if len(candidates) else candidates
        for slot in chosen.tolist():
            self.order.remove(slot)
        return chosen

    def ordered(self, slots):
        rank = {s: i for i, s in enumerate(self.order[::-1])}
        return np.array(sorted(slots.tolist(), key=rank.__getitem__), dtype=np.int64)


def test_eviction_returns_its_victims_and_the_policy_is_pluggable():
    index = BlockIndex(TierKind.HOST, 2, policy=MostRecentFirst())
    for key in (b"a", b"b"):
        plan = index.prepare_store("ns", [key])
        index.complete_store(plan.slots, [7])
    plan = index.prepare_store("ns", [b"c"])
    assert plan.outcomes == [Outcome.DONE]
    assert [(v.key, v.tier, v.checksum) for v in plan.evicted] == [(b"b", TierKind.HOST, 7)]  # newest went
    index.complete_store(plan.slots, [8])
    assert index.contains("ns", [b"a", b"b", b"c"]) == [True, False, True]
