"""The shared filesystem tier (issue 30): a directory several nodes mount, every call under a deadline.

Two cache groups of one name over one directory stand for two nodes. A stalled mount cannot be
made here (it needs a server that stops answering), so it is a mount call that sleeps past the
deadline, as a stalled NFS call blocks in the kernel."""

import threading
import time

import pytest
import torch

from kvxfer.core.records import Outcome, TierKind
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.registry import lower_tiers
from kvxfer.tiers.shared_fs.settings import SharedFsSettings

SPEC = KVSpec(2, 64, 16, 2, 32, torch.float16)  # 8 KiB blocks
HOST_BLOCKS = 8


def node(shared, timeout_s: float = 2.0, secret: bytes = b"") -> tuple[Pool, PoolManager]:
    pool = Pool.create("p", SPEC, Layout.parse("BLHNC"))
    pool.storage.copy_(torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8))
    group = CacheGroup("g", pool.layout, HOST_BLOCKS,
                       lower=lower_tiers(shared_fs=SharedFsSettings(str(shared), timeout_s, secret=secret)))
    return pool, PoolManager(pool, group)


def block(pool: Pool, b: int) -> torch.Tensor:
    span = pool.layout.block_bytes
    return pool.storage[b * span:(b + 1) * span].clone()


def offload(manager: PoolManager, blocks: range) -> None:
    for start in range(blocks.start, blocks.stop, 4):
        pairs = [(b, b"k%d" % b) for b in range(start, min(start + 4, blocks.stop))]
        assert manager.offload("ns", pairs).outcomes == [Outcome.DONE] * len(pairs)


def test_a_block_one_node_evicts_is_restored_by_another_bit_exact(tmp_path):
    a_pool, a = node(tmp_path)
    b_pool, b = node(tmp_path)
    try:
        offload(a, range(1, 21))  # 12 evicted from a's host tier to the shared directory
        assert a.group.lower_tiers[0].flush(10)
        keys = [b"k%d" % i for i in range(1, 13)]
        assert b.lookup("ns", keys).tiers == [TierKind.SHARED_FS] * 12
        assert b.restore("ns", [(k, 40 + i) for i, k in enumerate(keys[:4])]).outcomes == [Outcome.DONE] * 4
        for i in range(4):
            assert torch.equal(block(b_pool, 40 + i), block(a_pool, 1 + i))
        stats = b.group.tier_stats()[1]
        assert stats.tier is TierKind.SHARED_FS and stats.events["promoted"] == 4 and not stats.has_occupancy
    finally:
        a.group.close(5)
        b.group.close(5)


def test_a_changed_file_is_data_loss_and_removed_and_a_delete_is_final(tmp_path):
    pool, manager = node(tmp_path)
    tier = manager.group.lower_tiers[0]
    try:
        offload(manager, range(1, 13))  # k1..k4 evicted
        assert tier.flush(10)
        path = tier.fs.name("ns", b"k1")
        raw = bytearray(path.read_bytes())
        raw[5000] ^= 1
        path.write_bytes(bytes(raw))
        assert manager.restore("ns", [(b"k1", 40)]).outcomes == [Outcome.DATA_LOSS] and not path.exists()
        assert manager.delete("ns", [b"k2"]) == 1 and manager.lookup("ns", [b"k2"]).tiers == [None]
    finally:
        manager.group.close(5)


def test_with_a_secret_a_file_moved_from_another_share_path_or_forged_is_data_loss(tmp_path):
    """Two teams share a filesystem and a secret, each under its own path: a file one wrote, copied to the same
    name under the other's path, is refused (the MAC covers the full path), as is one written without the
    secret; the team's own files are served."""
    secret = b"s" * 32
    (tmp_path / "team-a").mkdir()
    (tmp_path / "team-b").mkdir()
    _, a = node(tmp_path / "team-a", secret=secret)
    b_pool, b = node(tmp_path / "team-b", secret=secret)
    _, keyless = node(tmp_path / "team-b")
    try:
        offload(a, range(1, 13))  # k1..k4 evicted to team-a's path
        offload(keyless, range(1, 13))  # and by a writer without the secret to team-b's
        assert a.group.lower_tiers[0].flush(10) and keyless.group.lower_tiers[0].flush(10)
        theirs, forged = a.group.lower_tiers[0].fs.name("ns", b"k1"), keyless.group.lower_tiers[0].fs.name("ns", b"k2")
        moved = b.group.lower_tiers[0].fs.name("ns", b"k1")
        moved.write_bytes(theirs.read_bytes())
        assert b.restore("ns", [(b"k1", 40), (b"k2", 41)]).outcomes == [Outcome.DATA_LOSS] * 2
        assert not moved.exists() and not forged.exists()
        offload(b, range(30, 42))  # its own: k30..k33 evicted, and served
        assert b.group.lower_tiers[0].flush(10)
        assert b.restore("ns", [(b"k30", 50)]).outcomes == [Outcome.DONE]
        assert torch.equal(block(b_pool, 50), block(b_pool, 30))
    finally:
        for manager in (a, b, keyless):
            manager.group.close(5)


def _files(where) -> set:
    return {p.relative_to(where) for p in where.rglob("*")}


@pytest.mark.parametrize("planted", ["group", "subdirectory"])
def test_a_link_planted_in_the_share_is_never_followed(tmp_path, planted):
    """With <share>/<group> or a block subdirectory a link to another directory, a daemon wrote 71 files
    and 63 directories there and a Delete removed 40 files there. Now nothing there is touched."""
    share, elsewhere = tmp_path / "share", tmp_path / "elsewhere"
    share.mkdir()
    elsewhere.mkdir()
    pool, manager = node(share)
    tier = manager.group.lower_tiers[0]
    try:
        offload(manager, range(1, 13))  # k1..k4 evicted and written
        assert tier.flush(10)
        sub = tier.fs.name("ns", b"k1").parent
        target = share / "g" if planted == "group" else sub
        aside = target.with_name(target.name + ".real")
        target.rename(aside)
        target.symlink_to(elsewhere, target_is_directory=True)
        # Files another party placed there, named as this tier would name them.
        (elsewhere / sub.name).mkdir()
        for key in (b"k1", b"k2"):
            name = tier.fs.name("ns", key)
            (elsewhere / name.name).write_bytes(b"theirs")
            (elsewhere / sub.name / name.name).write_bytes(b"theirs")
        before = {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
        assert manager.lookup("ns", [b"k1"]).tiers == [None]  # not seen through the link
        assert manager.restore("ns", [(b"k1", 40)]).outcomes == [Outcome.NOT_FOUND]
        manager.delete("ns", [b"k1", b"k2", b"k3", b"k4"])
        offload(manager, range(13, 40))  # more evictions: writes land only inside the share
        assert tier.flush(10)
        assert {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before
        assert len(_files(elsewhere)) == len(before) + 1  # the subdirectory they made, and nothing new
    finally:
        manager.group.close(5)


def test_a_write_queued_before_a_delete_is_never_written(tmp_path):
    pool, manager = node(tmp_path)
    tier = manager.group.lower_tiers[0]
    real, entered, release = tier.queue._write, threading.Event(), threading.Event()

    def held(batch):
        entered.set()
        release.wait(10)
        real(batch)

    tier.queue._write = held
    try:
        offload(manager, range(1, 13))
        assert entered.wait(10)
        keys = [b"k%d" % i for i in range(1, 5)]
        manager.delete("ns", keys)
        release.set()
        assert tier.flush(10)
        assert manager.lookup("ns", keys).tiers == [None] * 4 and tier.stats().events["deleted_while_queued"] == 4
    finally:
        manager.group.close(5)


def test_a_stalled_mount_turns_into_misses_within_the_deadline_and_recovers(tmp_path):
    pool, manager = node(tmp_path, timeout_s=0.2)
    tier = manager.group.lower_tiers[0]
    try:
        offload(manager, range(1, 13))
        assert tier.flush(10)
        stalled = threading.Event()
        real_exists, real_read = tier.fs.exists, tier.fs.read

        calls = []

        def stall(real):
            def call(*args):
                if stalled.is_set():
                    calls.append(real.__name__)
                    time.sleep(3)  # a call blocked in the kernel on a mount that does not answer
                return real(*args)
            return call

        tier.fs.exists, tier.fs.read = stall(real_exists), stall(real_read)
        stalled.set()
        assert manager.lookup("ns", [b"k1", b"k2", b"k3"]).tiers == [None] * 3
        assert manager.restore("ns", [(b"k1", 40)]).outcomes == [Outcome.NOT_FOUND]
        assert calls == ["exists"]  # one deadline, then the breaker: no call waits on the mount again
        assert tier.stats().degraded and tier.stats().events["stalled_lookup"] >= 1
        stalled.clear()
        time.sleep(0.6)  # the breaker's first backoff
        assert manager.lookup("ns", [b"k1"]).tiers == [TierKind.SHARED_FS] and not tier.stats().degraded
    finally:
        manager.group.close(5)


@pytest.mark.parametrize("section, message", [
    ({"path": "relative"}, "absolute path"),
    ({"path": "/nonexistent-kvxfer-mount"}, "is not a directory"),
    ({"path": "/tmp", "timeout_ms": 0}, "timeout_ms"),
    ({"path": "/tmp", "bogus": 1}, "must be a mapping"),
    ({"path": "/tmp", "secret_file": "/nonexistent-kvxfer-secret"}, "secret_file"),
    ({"path": "/tmp", "secret_file": "SHORT"}, "at least 16 bytes"),
])
def test_the_shared_fs_section_is_validated(tmp_path, section, message):
    from service import config

    if section.get("secret_file") == "SHORT":
        (tmp_path / "short").write_bytes(b"0123456789\n")
        section = {**section, "secret_file": str(tmp_path / "short")}
    path = tmp_path / "c.yaml"
    import yaml
    path.write_text(yaml.safe_dump({"shared_fs": section}))
    with pytest.raises(config.ConfigError, match=message):
        config.load(str(path))


def test_the_key_format_travels_with_the_block_to_the_node_that_restores_it(tmp_path):
    """Issue 46 item 2: a block stored with vLLM's key format is announced by another node, when it restores
    it from the shared directory, in that format (its STORED event names it by vLLM's block hash)."""
    from kvxfer.events.event_hub import EventHub
    from kvxfer.events.event_records import EngineBlocks, EventKind, KeyFormat
    from kvxfer.serving.batch import TransferBatch, TransferKind

    keys = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(1, 13)]
    a_pool, a = node(tmp_path)
    hub = EventHub()
    b_pool = Pool.create("p", SPEC, Layout.parse("BLHNC"))
    b = PoolManager(b_pool, CacheGroup("g", b_pool.layout, HOST_BLOCKS, kv_events=hub,
                                       lower=lower_tiers(shared_fs=SharedFsSettings(str(tmp_path), 2.0))))
    try:
        for first in range(0, 12, 4):
            a.run(TransferBatch.build(TransferKind.OFFLOAD, "ns", range(first + 1, first + 5), keys[first:first + 4],
                                      a.num_blocks, engine=EngineBlocks(KeyFormat.VLLM)))
        assert a.group.lower_tiers[0].flush(10)
        assert b.restore("ns", [(keys[0], 40)]).outcomes == [Outcome.DONE]
        (stored,) = [e for e in hub.read(0, 100)[0] if e.kind is EventKind.STORED]
        assert stored.tier is TierKind.HOST and stored.keys == (keys[0],)
        assert stored.engine is not None and stored.engine.key_format is KeyFormat.VLLM
    finally:
        a.group.close(5)
        b.group.close(5)
