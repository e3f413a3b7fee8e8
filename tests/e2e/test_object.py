"""The object-storage tier through real daemons against a real S3 server (SeaweedFS, ``kvxfer.bench.s3_server``):
two nodes sharing a bucket, forged, truncated, moved and foreign objects, a warm restart from the bucket, writes
and deletes racing, lookups (servers that stall, refuse or die: ``test_object_faults.py``)."""

import threading
import time

import pytest
import torch

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.bench.s3_server import S3Server
from kvxfer.core.records import Outcome, TierKind
from kvxfer.events.event_records import EventKind, Reason
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.tiers.object.client import object_name
from kvxfer.tiers.object.settings import ObjectSettings
from kvxfer.tiers.object.store import ObjectTier
from kvxfer.tiers.record import MAC_BYTES
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.object_node import KEYS, events, node, s3, tiers, until  # noqa: F401 (s3: a fixture)
from tests.e2e.test_remote import offload, restore

pytestmark = pytest.mark.e2e


def test_a_node_restores_bit_exact_what_another_demoted_to_the_bucket_and_deletes_stick(s3, tmp_path):
    a, b = node(s3, tmp_path, "shared"), node(s3, tmp_path, "shared")
    try:
        shadow = offload(a, KEYS)
        until(lambda: tiers(b, KEYS[:16]) == [TierKind.OBJECT] * 16, "b sees what a demoted")
        outcomes, blocks = restore(b, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8
        assert all(data.equal(shadow[key]) for key, data in zip(KEYS[:8], blocks))
        with Client(a.target) as client:
            assert client.delete(KEYS[8:10]) == 2  # in the bucket: gone for every node
        assert tiers(b, KEYS[8:11]) == [None, None, TierKind.OBJECT]
        assert events(a)["stored"] >= 16 and events(b)["promoted"] == 8
        names = s3.objects()
        assert len([n for n in names if n.startswith("shared/")]) >= 14 and all("/rank0/" in n for n in names
                                                                              if n.startswith("shared/"))
    finally:
        a.cleanup()
        b.cleanup()


def test_forged_truncated_and_foreign_objects_are_never_served(s3, tmp_path):
    daemon = node(s3, tmp_path, "attacked")
    try:
        offload(daemon, KEYS[:40])  # 8 demoted
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        client = s3.client()
        name = lambda key: f"attacked/{object_name('rank0', 'default', key)}"  # noqa: E731
        good = client.get_object(Bucket=s3.bucket, Key=name(KEYS[0]))["Body"].read()
        client.put_object(Bucket=s3.bucket, Key=name(KEYS[0]), Body=good[:-1] + bytes([good[-1] ^ 1]))  # forged
        client.put_object(Bucket=s3.bucket, Key=name(KEYS[1]), Body=good[:100])  # truncated
        client.put_object(Bucket=s3.bucket, Key=name(KEYS[2]), Body=good)  # another key's object moved here
        body = bytearray(good[:-MAC_BYTES])
        body[-1] ^= 1  # the bytes changed and the MAC recomputed without the secret: still forged
        client.put_object(Bucket=s3.bucket, Key=name(KEYS[3]), Body=bytes(body) + bytes(MAC_BYTES))
        outcomes, _ = restore(daemon, KEYS[:5])
        assert outcomes[:4] == [Outcome.DATA_LOSS] * 4 and outcomes[4] is Outcome.DONE
        assert events(daemon)["corrupt"] == 4
        assert not {name(k) for k in KEYS[:4]} & set(s3.objects())  # deleted from the bucket
        assert tiers(daemon, KEYS[:4]) == [None] * 4
        stored, corrupted = set(), set()  # KV events: stored into the bucket, then the corrupt ones removed
        with Client(daemon.target) as watcher:
            for batch in watcher.watch_events(["default"], from_sequence=1, timeout=30):
                for e in (e for e in batch.events if e.tier is TierKind.OBJECT):
                    (stored if e.kind is EventKind.STORED else corrupted if e.reason is Reason.CORRUPTED
                     else set()).update(e.keys)
                if set(KEYS[:8]) <= stored and corrupted == set(KEYS[:4]):
                    break
    finally:
        daemon.cleanup()


def test_an_object_moved_from_another_prefix_sharing_the_secret_is_never_served(s3, tmp_path):
    """Two teams (or staging and production) share a bucket and a secret under two prefixes: an object one wrote,
    copied under the same name into the other's prefix, was restored DONE there, repeatedly. The MAC covers the
    object's whole name, prefix included: it is DATA_LOSS, and removed."""
    a, b = node(s3, tmp_path, "team-a"), node(s3, tmp_path, "team-b")
    try:
        offload(a, KEYS[:40])  # 8 demoted into team-a/
        until(lambda: events(a).get("stored", 0) >= 8, "demoted")
        client = s3.client()
        for key in KEYS[:4]:
            name = object_name("rank0", "default", key)
            client.copy_object(Bucket=s3.bucket, Key=f"team-b/{name}", CopySource={"Bucket": s3.bucket,
                                                                                    "Key": f"team-a/{name}"})
        outcomes, _ = restore(b, KEYS[:4])
        assert outcomes == [Outcome.DATA_LOSS] * 4
        assert events(b)["corrupt"] == 4 and tiers(b, KEYS[:4]) == [None] * 4
        assert not any(n.startswith("team-b/") for n in s3.objects())  # removed where they did not belong
        outcomes, _ = restore(a, KEYS[:4])
        assert outcomes == [Outcome.DONE] * 4  # where they were written, they are good
    finally:
        a.cleanup()
        b.cleanup()


def test_a_restarted_daemon_finds_what_it_wrote_in_the_bucket(s3, tmp_path):
    daemon = node(s3, tmp_path, "warm")
    try:
        shadow = offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
    finally:
        daemon.cleanup()
    restarted = node(s3, tmp_path, "warm")
    try:
        assert tiers(restarted, KEYS[:8]) == [TierKind.OBJECT] * 8
        outcomes, blocks = restore(restarted, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
    finally:
        restarted.cleanup()


def _tier(s3: S3Server, monkeypatch, prefix: str, **settings) -> ObjectTier:
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return ObjectTier(ObjectSettings(f"s3://{s3.bucket}/{prefix}", s3.endpoint, allow_http=True, **settings), "g",
                      b"f" * 32, 4096)


def _block(seed: int) -> tuple[int, torch.Tensor]:
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return block_checksum(data.numpy()), data


def test_writers_of_one_key_at_once_never_clobber_each_other(s3, monkeypatch):
    writers = [_tier(s3, monkeypatch, "race", timeout_s=10.0) for _ in range(8)]
    blocks = [_block(i) for i in range(8)]
    start = threading.Barrier(len(writers))

    def store(i: int) -> None:
        start.wait()
        writers[i].stage("ns", [(b"same", *blocks[i])])

    threads = [threading.Thread(target=store, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(t.flush(30) for t in writers)
    counts = [t.stats().events for t in writers]
    # (SeaweedFS queues conditional puts of one name for about a second each: a loser may time out, a drop)
    losers = sum(e.get("already_present", 0) + e.get("stores_dropped", 0) + e.get("stores_unconfirmed", 0)
                 for e in counts)
    assert sum(e.get("stored", 0) for e in counts) == 1 and losers == 7
    (winner,) = [i for i, e in enumerate(counts) if e.get("stored")]
    fetch = writers[0].fetch("ns", [b"same"])
    out = torch.empty(4096, dtype=torch.uint8)
    assert fetch.read([(0, out)]) == [(Outcome.DONE, blocks[winner][0])] and out.equal(blocks[winner][1])
    for t in writers:
        t.close()


def test_a_lookup_of_unknown_keys_asks_once_and_remembers_the_misses_for_a_while(s3, monkeypatch):
    tier = _tier(s3, monkeypatch, "negative", negative_cache_s=60.0)
    keys = [b"unknown%d" % i for i in range(1024)]
    assert tier.contains("ns", keys) == [False] * 1024 and not tier.breaker.open
    assert tier.contains("ns", keys) == [False] * 1024
    assert tier.stats().events["lookups_cached"] == 1024  # the second asked nothing
    tier.stage("ns", [(keys[0], *_block(1))])  # a store of its own forgets the miss at once
    assert tier.flush(30) and tier.contains("ns", keys[:2]) == [True, False]
    assert not tier._written  # without max_bytes no index of what it wrote is kept (it would grow for ever)
    tier.close()


def test_max_bytes_keeps_the_newest_objects_this_daemon_wrote(s3, monkeypatch):
    tier = _tier(s3, monkeypatch, "bounded", max_bytes=4 * (4096 + 1024))
    for i in range(10):
        tier.stage("ns", [(b"k%d" % i, *_block(i))])
        assert tier.flush(30)
    kept = tier.contains("ns", [b"k%d" % i for i in range(10)])
    assert kept == [False] * 6 + [True] * 4 and tier.stats().events["evicted"] == 6
    tier.close()


def test_a_delete_overtakes_the_queued_write_of_its_key(s3, monkeypatch):
    tier = _tier(s3, monkeypatch, "tombstone")
    entered, release = threading.Event(), threading.Event()
    real = tier._put

    def held(staged):
        entered.set()
        release.wait(10)
        return real(staged)

    tier._put = held
    tier.stage("ns", [(b"first", *_block(1))])
    assert entered.wait(10)  # the writer holds the first batch; the next one queues behind it
    tier.stage("ns", [(b"queued", *_block(2))])
    deleting = threading.Thread(target=tier.delete, args=("ns", [b"queued"]))
    deleting.start()
    release.set()
    deleting.join(10)
    assert tier.flush(30)
    assert tier.contains("ns", [b"first", b"queued"]) == [True, False]
    tier.close()


def test_credentials_come_from_the_shared_files_where_the_environment_names_none(s3, tmp_path):
    """``aws configure``'s files, as a developer's machine has them: no AWS_* keys in the environment."""
    from kvxfer.bench.s3_server import ACCESS_KEY, SECRET_KEY

    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text(f"[default]\naws_access_key_id = nobody\naws_secret_access_key = wrong\n\n"
                           f"[kv]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    config.write_text("[profile kv]\nregion = us-east-1\n")
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_CONFIG_FILE": str(config)}
    section = {"url": f"s3://{s3.bucket}/files", "endpoint": s3.endpoint, "allow_http": True, "timeout_ms": 3000}
    good = launch.spawn({"pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "object": section},
                        env={**files, "AWS_PROFILE": "kv"})
    wrong = launch.spawn({"pools": [SMALL_POOL], "object": section}, wait=False, env=files)  # [default]: refused
    try:
        shadow = offload(good, KEYS[:40])
        until(lambda: tiers(good, KEYS[:8]) == [TierKind.OBJECT] * 8, "stored with the file's credentials")
        outcomes, blocks = restore(good, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
        assert wrong.proc.wait(60) != 0 and "credentials were refused" in wrong.log_text()
    finally:
        good.cleanup()
        wrong.cleanup()


def test_a_lookup_ends_by_the_request_s_deadline_even_when_the_tier_s_timeout_is_longer(s3, monkeypatch):
    from tests.e2e.slow_proxy import SlowProxy

    proxy = SlowProxy(("127.0.0.1", s3.ports["s3"]))
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    tier = ObjectTier(ObjectSettings(f"s3://{s3.bucket}/deadline", proxy.url, allow_http=True, timeout_s=20.0), "g",
                      b"f" * 32, 4096)
    try:
        proxy.delay_s = 10.0
        start = time.monotonic()
        assert tier.contains("ns", [b"a", b"b"], until=start + 0.5) == [False, False]
        assert time.monotonic() - start < 15  # (a hang guard: the request's deadline was 0.5 s)
        assert not tier.breaker.open  # the request ran out of time, the server did not fail
        proxy.delay_s = 0.0
        assert tier.contains("ns", [b"a"]) == [False]  # not remembered as absent: asked (and answered) now
        assert tier.stats().events.get("lookups_cached", 0) == 0
    finally:
        tier.close()
        proxy.close()


def test_another_format_s_object_under_a_name_is_a_miss_and_left_alone(s3, monkeypatch):
    """Daemons whose blocks differ (another geometry, or the checksum format of before) share a bucket: neither
    serves nor deletes the other's objects."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    settings = ObjectSettings(f"s3://{s3.bucket}/formats", s3.endpoint, allow_http=True)
    theirs, ours = ObjectTier(settings, "g", b"x" * 32, 4096), ObjectTier(settings, "g", b"f" * 32, 4096)
    try:
        theirs.stage("ns", [(b"k", *_block(7))])
        assert theirs.flush(30)
        fetch = ours.fetch("ns", [b"k"])
        assert fetch.keys == [] and ours.stats().events.get("corrupt", 0) == 0
        assert theirs.contains("ns", [b"k"]) == [True]  # still there for those it belongs to
    finally:
        theirs.close()
        ours.close()


def test_a_get_the_server_fails_is_failed_never_not_found(s3, monkeypatch):
    """The object is there (a HEAD says so) and its GET does not come back in time: the restore is told the
    medium failed, not that the block is absent (an engine recomputes either way; only one is true)."""
    from tests.e2e.slow_proxy import SlowProxy

    proxy = SlowProxy(("127.0.0.1", s3.ports["s3"]))
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    tier = ObjectTier(ObjectSettings(f"s3://{s3.bucket}/failed", proxy.url, allow_http=True, timeout_s=1.0), "g",
                      b"f" * 32, 4096)
    try:
        tier.stage("ns", [(b"k", *_block(3))])
        assert tier.flush(30) and tier.contains("ns", [b"k"]) == [True]
        proxy.delay_s = 3.0
        fetch = tier.fetch("ns", [b"k"])
        assert fetch.keys == [b"k"]
        assert fetch.read([(0, torch.empty(4096, dtype=torch.uint8))]) == [(Outcome.FAILED, 0)]
        fetch.end(set())
    finally:
        tier.close()
        proxy.close()
