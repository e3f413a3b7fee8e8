"""The disk tier with real files: demotion and promotion bit-exact, the index rebuilt, bad files dropped."""

import errno
import os
import stat

import pytest
import torch

from kvxfer.core.records import Outcome, TierKind
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.disk.files import HEADER_BYTES
from kvxfer.tiers.disk.settings import DiskSettings
from kvxfer.tiers.record import DiskCorrupt, decode_header, encode_header
from kvxfer.tiers.registry import lower_tiers

SPEC = KVSpec(2, 64, 16, 2, 32, torch.float16)  # 8 KiB blocks
HOST_BLOCKS = 8


def fill(pool: Pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for k, v in pool.views():
        k.copy_(torch.randn(k.shape, generator=gen).half())
        v.copy_(torch.randn(v.shape, generator=gen).half())


def block(pool: Pool, b: int) -> torch.Tensor:
    return torch.stack([torch.stack([k[b], v[b]]) for k, v in pool.views()]).clone()


def store(tmp_path, layout="BLHNC", capacity_mib=1.0, **disk):
    pool = Pool.create("p", SPEC, Layout.parse(layout))
    settings = DiskSettings(str(tmp_path), int(capacity_mib * (1 << 20)), **disk)
    group = CacheGroup("g", pool.layout, HOST_BLOCKS, lower=lower_tiers(disk=settings))
    return pool, group, PoolManager(pool, group)


def offload_all(manager: PoolManager, blocks: range) -> None:
    for start in range(blocks.start, blocks.stop, 4):  # batches smaller than the host tier
        pairs = [(b, b"k%d" % b) for b in range(start, min(start + 4, blocks.stop))]
        assert manager.offload("ns", pairs).outcomes == [Outcome.DONE] * len(pairs)


def stored_and_shut_down(tmp_path, seed: int, blocks: int) -> CacheGroup:
    """Blocks 1..blocks offloaded (all but the host tier's on disk), the host tier written down
    and the group closed as SIGTERM does; returns the closed group."""
    pool, group, manager = store(tmp_path)
    fill(pool, seed)
    offload_all(manager, range(1, blocks + 1))
    assert group.demote_all(10) == HOST_BLOCKS
    group.close(5)
    return group


def restore_all(manager: PoolManager, original: dict[int, torch.Tensor]) -> tuple[list[bytes], list[Outcome]]:
    """Restore blocks 1-24's keys into blocks 1-24, four at a time; each DONE one is bit-exact."""
    keys, results = [b"k%d" % b for b in range(1, 25)], []
    for start in range(0, 24, 4):
        results += manager.restore("ns", [(keys[i], i + 1) for i in range(start, start + 4)]).outcomes
    for i, outcome in enumerate(results):
        if outcome is Outcome.DONE:
            assert torch.equal(block(manager.pool, i + 1), original[i + 1])
    return keys, results


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC", "L,KV,B,N,H,D"])
def test_evicted_blocks_go_to_disk_and_come_back_bit_exact(tmp_path, layout):
    pool, group, manager = store(tmp_path, layout)
    fill(pool, 1)
    original = {b: block(pool, b) for b in range(1, 41)}
    offload_all(manager, range(1, 41))
    assert group.tier(TierKind.DISK).flush(10)
    tiers = manager.lookup("ns", [b"k%d" % b for b in range(1, 41)]).tiers
    assert tiers.count(TierKind.DISK) == 40 - HOST_BLOCKS and tiers.count(TierKind.HOST) == HOST_BLOCKS
    for k, v in pool.views():
        k.zero_()
        v.zero_()
    for start in range(1, 41, 4):  # host blocks and disk blocks in one restore, into other blocks
        # Promotions evict host blocks; until written, a block on its way down is found in neither tier.
        assert group.tier(TierKind.DISK).flush(10)
        pairs = [(b"k%d" % b, b + 20) for b in range(start, start + 4)]
        assert manager.restore("ns", pairs).outcomes == [Outcome.DONE] * 4
        for b in range(start, start + 4):
            assert torch.equal(block(pool, b + 20), original[b])
    disk = group.tier(TierKind.DISK).stats()
    assert disk.events["demoted"] >= 32 and disk.events["promoted"] >= 32 and not disk.degraded
    group.close(5)


def test_a_restart_rebuilds_the_index_and_drops_every_bad_file(tmp_path):
    pool, group, manager = store(tmp_path)
    fill(pool, 2)
    original = {b: block(pool, b) for b in range(1, 25)}
    offload_all(manager, range(1, 25))
    assert group.demote_all(10) == HOST_BLOCKS  # what SIGTERM does
    group.close(5)
    (tmp_path / "g" / ".checkpoint").unlink()  # as after a crash: the next start scans the files
    files = sorted((tmp_path / "g").rglob("*.kvb"))
    assert len(files) == 24
    os.truncate(files[0], 100)  # truncated
    with open(files[1], "r+b") as f:  # a header byte flipped
        f.seek(40)
        f.write(bytes([f.read(1)[0] ^ 1]))
    with open(files[2], "r+b") as f:  # a data byte flipped: caught when read
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([f.read(1)[0] ^ 1]))
    (files[3].parent / "00000003.tmp").write_bytes(b"half")  # a crash mid-write
    _, group2, manager2 = store(tmp_path)
    disk = group2.tier(TierKind.DISK).stats()
    assert disk.events["found_at_start"] == 22 and disk.ready_blocks == 22
    assert disk.events["dropped_at_start_truncated"] == 1 and disk.events["dropped_at_start_bad_header"] == 1
    assert disk.events["dropped_at_start_incomplete"] == 1
    keys, results = restore_all(manager2, original)
    assert results.count(Outcome.DATA_LOSS) == 1 and results.count(Outcome.NOT_FOUND) == 2
    assert manager2.lookup("ns", keys).tiers.count(None) == 3  # the bad ones are gone for good
    group2.close(5)


def test_a_clean_restart_reads_the_checkpoint_and_still_catches_files_damaged_since(tmp_path):
    """Issue 32: one file read at start instead of a header per block; what changed on disk after the
    shutdown is caught when read (DATA_LOSS, the entry dropped), never served."""
    pool, group, manager = store(tmp_path)
    fill(pool, 3)
    original = {b: block(pool, b) for b in range(1, 25)}
    offload_all(manager, range(1, 25))
    assert group.demote_all(10) == HOST_BLOCKS
    group.close(5)
    checkpoint = tmp_path / "g" / ".checkpoint"
    assert checkpoint.is_file() and stat.S_IMODE(checkpoint.stat().st_mode) == 0o600
    files = sorted((tmp_path / "g").rglob("*.kvb"))
    os.truncate(files[0], 100)
    with open(files[1], "r+b") as f:  # a header byte flipped
        f.seek(40)
        f.write(bytes([f.read(1)[0] ^ 1]))
    _, group2, manager2 = store(tmp_path)
    disk = group2.tier(TierKind.DISK).stats()
    assert disk.events["found_at_start"] == 24 and not disk.loading
    assert not any(e.startswith("dropped_at_start") for e in disk.events)  # no scan
    assert not checkpoint.exists()  # consumed: a crash from now on means a scan
    keys, results = restore_all(manager2, original)
    assert results.count(Outcome.DATA_LOSS) == 2 and results.count(Outcome.DONE) == 22
    assert manager2.lookup("ns", keys).tiers.count(None) == 2
    group2.close(5)


@pytest.mark.parametrize("damage", ["garbage", "bad hash", "other format", "too large", "a link"])
def test_a_checkpoint_that_is_not_ours_is_ignored_and_the_files_are_scanned(tmp_path, damage):
    group = stored_and_shut_down(tmp_path, 4, 12)
    checkpoint = tmp_path / "g" / ".checkpoint"
    data = checkpoint.read_bytes()
    if damage == "garbage":
        checkpoint.write_bytes(b"\0" * 64)
    elif damage == "bad hash":
        checkpoint.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "other format":
        fingerprint = group.tier(TierKind.DISK).tier.fingerprint
        checkpoint.write_bytes(data.replace(fingerprint, bytes(len(fingerprint))))
    elif damage == "too large":
        with checkpoint.open("ab") as f:
            f.truncate(10 << 20)
    else:
        checkpoint.unlink()
        (tmp_path / "target").write_bytes(data)
        checkpoint.symlink_to(tmp_path / "target")
    _, group2, manager2 = store(tmp_path)
    disk = group2.tier(TierKind.DISK).stats()
    assert disk.events["found_at_start"] == 12  # from the files' own headers
    assert (tmp_path / "target").exists() if damage == "a link" else True  # a link's target is never touched
    assert not checkpoint.exists() and not checkpoint.is_symlink()
    group2.close(5)


def test_a_background_load_serves_misses_queues_demotions_and_applies_deletes(tmp_path, monkeypatch):
    """The daemon's way: the index loads on a thread while the daemon serves. What the host tier evicts meanwhile
    is queued and written once the index is loaded (it was dropped: a host tier filled right after a start left
    nothing on disk), unless a Delete of it came meanwhile."""
    import threading

    from kvxfer.tiers.disk.files import DiskTier

    stored_and_shut_down(tmp_path, 5, 16)
    (tmp_path / "g" / ".checkpoint").unlink()  # a scan
    release = threading.Event()
    scan = DiskTier.scan
    monkeypatch.setattr(DiskTier, "scan", lambda self, stop=lambda: False: (release.wait(30), scan(self, stop))[1])
    _, group2, manager2 = store(tmp_path, load_in_background=True)
    disk = group2.tier(TierKind.DISK)
    assert disk.stats().loading and disk.contains("ns", [b"k1"]) == [False]  # a miss, not a wait
    assert manager2.delete("ns", [b"k2"]) >= 0  # applied once the files are known
    block = torch.full((disk.queue.staging.nbytes,), 7, dtype=torch.uint8)
    disk.stage("ns", [(b"new", 1, block), (b"gone", 2, block)])
    manager2.delete("ns", [b"gone"])
    assert disk.stats().events.get("demotions_dropped_loading", 0) == 0 and disk.contains("ns", [b"new"]) == [False]
    release.set()
    for _ in range(300):
        if not disk.stats().loading:
            break
        threading.Event().wait(0.01)
    stats = disk.stats()
    assert not stats.loading and stats.events["found_at_start"] == 16
    assert disk.contains("ns", [b"k1", b"k2"]) == [True, False]
    assert not any(f.name == "k2" for f in (tmp_path / "g").rglob("*.kvb"))
    assert disk.flush(30) and disk.contains("ns", [b"new", b"gone"]) == [True, False]
    group2.close(5)


def test_a_foreign_block_format_is_never_served(tmp_path):
    _, group, manager = store(tmp_path)
    fill(manager.pool, 3)
    offload_all(manager, range(1, 13))
    group.demote_all(10)
    group.close(5)
    other = Pool.create("q", KVSpec(2, 64, 16, 2, 32, torch.bfloat16), Layout.parse("BLHNC"))  # same size
    group2 = CacheGroup("g", other.layout, HOST_BLOCKS, lower=lower_tiers(disk=DiskSettings(str(tmp_path), 1 << 20)))
    assert group2.tier(TierKind.DISK).stats().events["dropped_at_start_foreign_format"] == 12
    group2.close(5)


def test_a_failing_device_fails_the_block_and_marks_the_tier_degraded(tmp_path, monkeypatch):
    pool, group, manager = store(tmp_path)
    fill(pool, 4)
    offload_all(manager, range(1, 17))
    assert group.tier(TierKind.DISK).flush(10)
    victim = group.tier(TierKind.DISK).index.entries()[0]
    read_into = group.tier(TierKind.DISK).tier.read_into

    def dead_sector(slot, *args):
        if slot == victim[2]:
            raise OSError(errno.EIO, "Input/output error")
        return read_into(slot, *args)

    monkeypatch.setattr(group.tier(TierKind.DISK).tier, "read_into", dead_sector)
    result = manager.restore("ns", [(victim[1], 40), (b"k16", 41)])
    assert result.outcomes == [Outcome.FAILED, Outcome.DONE]
    stats = group.tier(TierKind.DISK).stats()
    assert stats.degraded and stats.events["read_errors"] == 1
    assert manager.offload("ns", [(2, b"new")]).outcomes == [Outcome.DONE]  # the host path goes on
    group.close(5)


def test_a_full_demotion_queue_drops_and_counts_instead_of_waiting(tmp_path):
    pool, group, manager = store(tmp_path, queue_blocks=1)
    fill(pool, 5)
    offload_all(manager, range(1, 41))
    group.tier(TierKind.DISK).flush(10)
    events = group.tier(TierKind.DISK).stats().events
    assert events["demotions_dropped"] > 0 and events["demoted"] + events["demotions_dropped"] == 32
    group.close(5)


def test_the_header_names_its_block_and_format():
    header = encode_header(b"f" * 32, "ns:x", b"key\x00\xff", 1234, 8192, pad_to=HEADER_BYTES, key_format=1)
    expected = ("ns:x", b"key\x00\xff", 1234, 1)  # (the key's format: its events name it alike after a restart)
    assert len(header) == HEADER_BYTES and decode_header(header, b"f" * 32, 8192, HEADER_BYTES) == expected
    for fingerprint, nbytes in ((b"g" * 32, 8192), (b"f" * 32, 4096)):
        with pytest.raises(DiskCorrupt, match="foreign_format"):
            decode_header(header, fingerprint, nbytes, HEADER_BYTES)
    with pytest.raises(DiskCorrupt, match="truncated"):
        decode_header(header[:100], b"f" * 32, 8192, HEADER_BYTES)
    compact = encode_header(b"f" * 32, "ns:x", b"key\x00\xff", 1234, 8192, key_format=1)  # the remote tier's
    assert decode_header(compact, b"f" * 32, 8192) == expected and len(compact) < 100
    # A version 1 header (written before key formats were kept) still reads: an opaque key.
    import struct
    import zlib
    body = struct.pack("<8sII32sQQHH", b"KVXFDSK1", 1, 0, b"f" * 32, 1234, 8192, 4, 5) + b"ns:x" + b"key\x00\xff"
    old = body[:12] + struct.pack("<I", zlib.crc32(body)) + body[16:]
    assert decode_header(old, b"f" * 32, 8192) == ("ns:x", b"key\x00\xff", 1234, 0)
    flipped = bytearray(compact)
    flipped[-1] ^= 1
    with pytest.raises(DiskCorrupt, match="bad_header"):
        decode_header(bytes(flipped), b"f" * 32, 8192)


def test_files_are_private_to_the_daemon(tmp_path):
    _, group, manager = store(tmp_path)
    offload_all(manager, range(1, 13))
    group.demote_all(10)
    group.close(5)
    for path in (tmp_path / "g").rglob("*.kvb"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_write_that_breaks_midway_leaves_no_pinned_or_invisible_entries(tmp_path):
    pool, group, manager = store(tmp_path)
    fill(pool, 6)

    def broken(blocks):
        raise RuntimeError("a bug in the write path")  # nothing the device can be made to do on demand

    group.tier(TierKind.DISK).tier.write_batch = broken
    offload_all(manager, range(1, 17))  # 8 demotions reach the broken writer
    group.tier(TierKind.DISK).flush(10)
    stats = group.tier(TierKind.DISK).stats()
    assert stats.pinned_blocks == 0 and stats.used_blocks == 0 and stats.events["write_errors"] == 8
    assert manager.restore("ns", [(b"k16", 40)]).outcomes == [Outcome.DONE]  # the host path goes on
    group.close(5)


def test_a_key_named_twice_in_a_delete_is_removed_once_from_both_tiers(tmp_path):
    pool, group, manager = store(tmp_path)
    fill(pool, 3)
    offload_all(manager, range(1, 21))  # 8 in the host tier, 12 on disk
    assert group.tier(TierKind.DISK).flush(10)
    assert manager.delete("ns", [b"k1", b"k1", b"k20", b"k20", b"absent"]) == 2  # k1 on disk, k20 in host memory
    assert manager.lookup("ns", [b"k1"]).tiers == [None] and manager.lookup("ns", [b"k20"]).tiers == [None]
    for tier in manager.stats().tiers:
        assert tier.pinned_blocks == 0 and tier.used_blocks == tier.ready_blocks


def test_a_directory_in_a_slots_place_is_set_aside_when_the_slot_is_written(tmp_path):
    from kvxfer.tiers.disk.files import QUARANTINE, Block, DiskTier

    tier = DiskTier(tmp_path / "t", 8, 64, b"f" * 16)
    (tier.path(3) / "inside").mkdir(parents=True)  # a directory where slot 3's file goes
    tier.path(4).with_suffix(".tmp").mkdir()  # and one at slot 4's temporary name
    (tmp_path / "t" / QUARANTINE).symlink_to(tmp_path)  # a link where the quarantine goes: never followed
    blocks = [Block(s, "ns", b"k%d" % s, 7, memoryview(bytes([s]) * 64)) for s in (3, 4)]
    assert tier.write_batch(blocks) == [None, None]
    assert tier.path(3).is_file() and tier.path(4).is_file()
    aside = list((tmp_path / "t" / QUARANTINE).iterdir())
    assert len(aside) == 2 and not (tmp_path / "t" / QUARANTINE).is_symlink()
    assert {p.name for p in tmp_path.iterdir()} == {"t"}  # nothing moved into the link's target


@pytest.mark.parametrize("when", ["queued", "half_written"])
def test_a_deleted_key_never_comes_back_from_the_write_queue(tmp_path, when):
    """Issue 30, item 2: Delete removed only blocks already on disk; one still queued or being
    written was published afterwards, found by Lookup and adopted again after a restart."""
    import threading

    pool, group, manager = store(tmp_path)
    fill(pool, 4)
    real, entered, release = group.tier(TierKind.DISK).tier.write_batch, threading.Event(), threading.Event()

    def held(blocks):
        if when == "half_written":
            errors = real(blocks)  # durable on disk, not yet published
            entered.set()
            release.wait(10)
            return errors
        entered.set()
        release.wait(10)
        return real(blocks)

    group.tier(TierKind.DISK).tier.write_batch = held
    offload_all(manager, range(1, 13))  # k1..k4 evicted to disk: the writer holds them
    assert entered.wait(10)
    offload_all(manager, range(13, 17))  # k5..k8 evicted too: queued behind the held batch
    deleted = [b"k%d" % b for b in range(1, 9)]
    assert manager.delete("ns", deleted) == 0  # nothing published yet
    release.set()
    assert group.tier(TierKind.DISK).flush(10)
    assert manager.lookup("ns", deleted).tiers == [None] * 8
    disk = group.tier(TierKind.DISK)
    assert disk.stats().events["deleted_while_queued"] == 8 and len(disk.tombstones) == 0
    offload_all(manager, range(17, 21))  # a key stored again after its Delete is kept
    assert manager.offload("ns", [(3, b"k3")]).outcomes == [Outcome.DONE]
    assert manager.lookup("ns", [b"k3"]).tiers == [TierKind.HOST]
    group.close(5)
    _, again, restarted = store(tmp_path)
    assert restarted.lookup("ns", deleted[:2] + deleted[3:]).tiers == [None] * 7  # not adopted from disk either
    again.close(5)


def test_a_fifo_or_link_planted_as_the_checkpoints_temporary_never_stalls_a_shutdown(tmp_path):
    """The writer replaces whatever stands at .checkpoint.tmp (a FIFO would block an open for writing)."""
    pool, group, manager = store(tmp_path)
    fill(pool, 6)
    offload_all(manager, range(1, 13))
    assert group.demote_all(10) == HOST_BLOCKS
    os.mkfifo(tmp_path / "g" / ".checkpoint.tmp", 0o600)
    group.close(5)
    assert (tmp_path / "g" / ".checkpoint").is_file()
    _, group2, _ = store(tmp_path)
    assert group2.tier(TierKind.DISK).stats().events["found_at_start"] == 12
    disk = group2.tier(TierKind.DISK)
    assert not any(e.startswith("dropped_at_start") for e in disk.stats().events)  # from the checkpoint
    group2.close(5)
    assert disk.index.entries() == [e for batch in disk.index.entry_batches(5) for e in batch]
