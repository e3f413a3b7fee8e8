"""Warm from the first request (issue 46): a Lookup or Restore while the disk index still loads waits for
it and hits; the ranks of a TP engine restoring one disk key at once share one promotion and all get it;
blocks loaded from disk keep their key format; an entry whose file is gone is a miss, removed."""

import threading
import time

import torch

from kvxfer.core.records import Outcome, TierKind
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import EventKind, Reason
from kvxfer.geometry.layout import Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.disk.files import DiskTier
from kvxfer.tiers.disk.settings import DiskSettings
from kvxfer.tiers.registry import lower_tiers
from tests.unit.test_disk_tier import HOST_BLOCKS, SPEC, block, fill, offload_all, store, stored_and_shut_down

KEYS = [b"k%d" % b for b in range(1, 9)]  # on disk after stored_and_shut_down(..., 16): the oldest eight


def in_thread(fn, *args):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    return thread, out


def test_a_lookup_and_a_restore_during_the_index_load_wait_for_it_and_hit(tmp_path, monkeypatch):
    stored_and_shut_down(tmp_path, 5, 16)
    (tmp_path / "g" / ".checkpoint").unlink()  # a scan: the slow start
    release = threading.Event()
    scan = DiskTier.scan
    monkeypatch.setattr(DiskTier, "scan", lambda self, stop=lambda: False: (release.wait(60), scan(self, stop))[1])
    pool, group, manager = store(tmp_path, load_in_background=True)
    assert group.tier(TierKind.DISK).stats().loading
    lookup, looked = in_thread(manager.lookup, "ns", KEYS)
    restore, restored = in_thread(manager.restore, "ns", [(k, 20 + i) for i, k in enumerate(KEYS[:4])])
    time.sleep(0.3)  # (both asked before the load ended: the old code answered them with misses at once)
    release.set()
    lookup.join(60)
    restore.join(60)
    assert looked[0].tiers == [TierKind.DISK] * len(KEYS) and looked[0].hits == len(KEYS)
    assert restored[0].outcomes == [Outcome.DONE] * 4
    group.close(5)


def test_a_load_that_outlasts_the_deadline_is_a_miss_in_time(tmp_path, monkeypatch):
    stored_and_shut_down(tmp_path, 5, 16)
    (tmp_path / "g" / ".checkpoint").unlink()
    release = threading.Event()
    scan = DiskTier.scan
    monkeypatch.setattr(DiskTier, "scan", lambda self, stop=lambda: False: (release.wait(60), scan(self, stop))[1])
    _, group, manager = store(tmp_path, load_in_background=True)
    try:
        assert manager.lookup("ns", KEYS, deadline=time.monotonic()).tiers == [None] * len(KEYS)  # no wait left
    finally:
        release.set()
        group.close(5)


def test_ranks_restoring_one_disk_key_at_once_share_one_promotion(tmp_path, monkeypatch):
    """Two pools of one cache group (what TP ranks of canonical blocks are to it) restore the same disk keys
    at the same moment: the second waits for the first's promotion and both get every block."""
    stored_and_shut_down(tmp_path, 6, 16)
    pools = [Pool.create(f"p{r}", SPEC, Layout.parse("BLHNC")) for r in range(2)]
    group = CacheGroup("g", pools[0].layout, HOST_BLOCKS, lower=lower_tiers(disk=DiskSettings(str(tmp_path), 1 << 20)))
    managers = [PoolManager(p, group) for p in pools]
    reading, release = threading.Event(), threading.Event()
    read_into = group.tier(TierKind.DISK).tier.read_into

    def slow_read(*args):
        reading.set()
        release.wait(60)
        return read_into(*args)

    monkeypatch.setattr(group.tier(TierKind.DISK).tier, "read_into", slow_read)
    pairs = [(k, 10 + i) for i, k in enumerate(KEYS[:4])]
    first, first_out = in_thread(managers[0].restore, "ns", pairs)
    assert reading.wait(60)  # rank 0 is reading the files
    second, second_out = in_thread(managers[1].restore, "ns", pairs)
    time.sleep(0.3)  # rank 1 asks meanwhile (the old code answered it NOT_FOUND at once)
    release.set()
    first.join(60)
    second.join(60)
    assert first_out[0].outcomes == [Outcome.DONE] * 4 and second_out[0].outcomes == [Outcome.DONE] * 4
    for i in range(4):
        assert torch.equal(block(pools[0], 10 + i), block(pools[1], 10 + i))
    assert group.tier(TierKind.DISK).stats().events["promoted"] == 4  # one promotion, not one a rank
    group.close(5)



def test_blocks_loaded_from_disk_are_announced_by_the_engines_hashes_after_a_restart(tmp_path, monkeypatch):
    """Issue 46 item 2: the key format is kept with every block below host memory (file header, journal,
    checkpoint), so that after a restart the vLLM-format stream names blocks by vLLM's block hash and group
    index: when loaded, promoted, evicted and deleted, as before the restart."""
    from kvxfer.events.event_hub import EventHub
    from kvxfer.events.event_records import EngineBlocks, KeyFormat
    from kvxfer.events.vllm_wire import BlockRemoved, BlockStored, VllmEncoder
    from kvxfer.serving.batch import TransferBatch, TransferKind
    from kvxfer.tiers.disk import checkpoint as disk_checkpoint
    from kvxfer.tiers.registry import placements

    keys = [bytes([i]) * 32 + (2).to_bytes(4, "big") for i in range(1, 17)]  # vLLM offload keys, group 2

    def start():
        hub = EventHub()
        pool = Pool.create("p", SPEC, Layout.parse("BLHNC"))
        group = CacheGroup("g", pool.layout, HOST_BLOCKS, kv_events=hub,
                           lower=lower_tiers(disk=DiskSettings(str(tmp_path), 1 << 20)))
        return hub, pool, group, PoolManager(pool, group)

    def vllm_events(hub):
        return [e for event in hub.read(0, 100_000)[0] for e in VllmEncoder(placement=placements()).convert(event)]

    for source in ("checkpoint", "journal", "scan"):
        hub, pool, group, manager = start()
        for first in range(0, 16, 4):
            manager.run(TransferBatch.build(TransferKind.OFFLOAD, "ns", range(first + 1, first + 5),
                                            keys[first:first + 4], manager.num_blocks,
                                            engine=EngineBlocks(KeyFormat.VLLM)))
        group.demote_all(10)
        if source == "journal":  # as after a crash: no checkpoint, the base and journal replayed
            with monkeypatch.context() as patch:
                patch.setattr(disk_checkpoint, "write", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
                group.close(5)
            assert (tmp_path / "g" / ".journal").exists() and not (tmp_path / "g" / ".checkpoint").exists()
        else:
            group.close(5)
        if source == "scan":  # the headers read
            (tmp_path / "g" / ".checkpoint").unlink()
        del group, manager
        hub, pool, group, manager = start()
        loaded = [e for e in vllm_events(hub) if isinstance(e, BlockStored) and e.medium == "DISK"]
        assert sorted(h for e in loaded for h in e.block_hashes) == sorted(k[:-4] for k in keys), source
        assert {e.group_idx for e in loaded} == {2}
        manager.restore("ns", [(keys[0], 30)])  # promoted into the host tier: announced alike
        manager.delete("ns", [keys[1]])
        events = vllm_events(hub)
        assert any(isinstance(e, BlockStored) and e.medium == "CPU" and e.block_hashes == [keys[0][:-4]]
                   and e.group_idx == 2 for e in events), source
        assert any(isinstance(e, BlockRemoved) and e.medium == "DISK" and e.block_hashes == [keys[1][:-4]]
                   and e.group_idx == 2 for e in events), source
        assert all(len(h) == 32 for e in events for h in getattr(e, "block_hashes", [])), source
        group.close(5)
        for leftover in (".checkpoint", ".base", ".journal"):
            (tmp_path / "g" / leftover).unlink(missing_ok=True)
        for f in (tmp_path / "g").rglob("*.kvb"):
            f.unlink()


def test_an_entry_whose_file_is_gone_is_removed_when_read_and_the_restore_goes_on(tmp_path):
    """Issue 46 item 6: a journal (or checkpoint) entry whose block file is gone is a miss, removed and
    announced once it is read (not TIER_DISK forever, not a failure that marks the tier degraded)."""
    pool = Pool.create("p", SPEC, Layout.parse("BLHNC"))
    hub = EventHub()
    group = CacheGroup("g", pool.layout, HOST_BLOCKS, kv_events=hub,
                       lower=lower_tiers(disk=DiskSettings(str(tmp_path), 1 << 20)))
    manager = PoolManager(pool, group)
    fill(pool, 9)
    offload_all(manager, range(1, 17))
    assert group.tier(TierKind.DISK).flush(10)
    namespace, key, slot = group.tier(TierKind.DISK).index.entries()[0][:3]
    group.tier(TierKind.DISK).tier.path(slot).unlink()  # removed behind the daemon's back
    assert manager.lookup("ns", [key]).tiers == [TierKind.DISK]  # (nothing has read it yet)
    assert manager.restore("ns", [(key, 40)]).outcomes == [Outcome.NOT_FOUND]
    assert manager.lookup("ns", [key]).tiers == [None]  # gone for good
    removed = [e for e in hub.read(0, 10_000)[0] if e.kind is EventKind.REMOVED and key in e.keys
               and e.tier is TierKind.DISK]
    assert [(e.tier, e.reason) for e in removed] == [(TierKind.DISK, Reason.EXPIRED)]
    assert group.tier(TierKind.DISK).flush(10)  # (the promotion's evictions on their way down)
    stats = group.tier(TierKind.DISK).stats()
    assert stats.events["missing"] == 1 and not stats.degraded and stats.pinned_blocks == 0
    other = next(e.key for e in group.tier(TierKind.DISK).index.entries())
    assert manager.restore("ns", [(other, 41)]).outcomes == [Outcome.DONE]  # the others are served
    group.close(5)
    _, group2, manager2 = store(tmp_path)  # the journal said so: the next start does not bring it back
    assert manager2.lookup("ns", [key]).tiers == [None]
    group2.close(5)
