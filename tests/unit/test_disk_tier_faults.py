"""The disk tier's promises under a race and under too little room: a Delete acknowledged while the index loads
is never undone at any instant, and a Restore larger than the host tier says the tier had no room for what the
disk holds, never NOT_FOUND."""

import time

import torch

from kvxfer.core.records import Outcome, TierKind
from tests.unit.test_disk_tier import block, fill, offload_all, store, stored_and_shut_down


def test_a_delete_acknowledged_during_the_load_is_never_undone_at_any_instant(tmp_path, monkeypatch):
    """The Deletes that came while the index loaded are applied before the tier serves what the load adopted: a
    watcher asking all the while never sees a deleted block (the end of the load widened to 0.3 s: before, the tier
    served between its 'loaded' and the Deletes being applied)."""
    import threading

    from kvxfer.tiers.disk.files import DiskTier
    from kvxfer.tiers.disk.store import DiskStore

    stored_and_shut_down(tmp_path, 5, 16)
    (tmp_path / "g" / ".checkpoint").unlink()  # a scan
    release = threading.Event()
    scan, apply = DiskTier.scan, DiskStore._delete_loaded
    monkeypatch.setattr(DiskTier, "scan", lambda self, stop=lambda: False: (release.wait(30), scan(self, stop))[1])
    monkeypatch.setattr(DiskStore, "_delete_loaded",
                        lambda self, ns, keys: (threading.Event().wait(0.3), apply(self, ns, keys))[1])
    _, group2, manager2 = store(tmp_path, load_in_background=True)
    disk = group2.tier(TierKind.DISK)
    assert manager2.delete("ns", [b"k2"]) >= 0  # acknowledged while loading
    seen, done = [], threading.Event()

    def watch() -> None:
        while not done.is_set():
            fetch = disk.fetch("ns", [b"k2"])
            seen.append(disk.contains("ns", [b"k2"])[0] or bool(fetch.keys))
            fetch.end(set())
    watcher = threading.Thread(target=watch)
    watcher.start()
    release.set()
    for _ in range(3000):  # a hang guard
        if not disk.stats().loading:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.1)
    done.set()
    watcher.join(30)
    assert seen and not any(seen)
    assert disk.contains("ns", [b"k1", b"k2"]) == [True, False]
    group2.close(5)


def test_a_restore_larger_than_the_host_tier_says_it_had_no_room_never_not_found(tmp_path):
    """A host tier of 8, 24 blocks on disk, one Restore of 16 of them: 8 come up and load, and the other 8 (on disk,
    as Lookup says) were reported NOT_FOUND; now RESOURCE_EXHAUSTED: the tier had no room, and an engine knows the
    block exists."""
    pool, group, manager = store(tmp_path)
    fill(pool, 7)
    original = {b: block(pool, b) for b in range(1, 33)}
    offload_all(manager, range(1, 33))
    group.demote_all(10)
    deadline = time.monotonic() + 30  # a hang guard: the demotions are written
    keys = [b"k%d" % b for b in range(1, 17)]
    while group.tiers_of("ns", keys) != [TierKind.DISK] * 16:
        assert time.monotonic() < deadline, group.tiers_of("ns", keys)
        time.sleep(0.02)
    result = manager.restore("ns", [(k, 33 + i) for i, k in enumerate(keys)])
    assert result.outcomes == [Outcome.DONE] * 8 + [Outcome.RESOURCE_EXHAUSTED] * 8
    assert all(torch.equal(block(pool, 33 + i), original[1 + i]) for i in range(8))
    assert group.tiers_of("ns", keys[8:]) == [TierKind.DISK] * 8  # still there, for a restore in smaller rounds
    assert manager.restore("ns", [(k, 33 + i) for i, k in enumerate(keys[8:])]).outcomes == [Outcome.DONE] * 8
    group.close(5)
