"""The object-storage tier through real daemons against a real S3 server (SeaweedFS, ``kvxfer.bench.s3_server``):
two nodes sharing a bucket, forged, truncated and foreign objects, a stalled server, refused starts, a warm
restart from the bucket (issue 49)."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.events.records import EventKind, Reason
from kvxfer.records import Outcome, TierKind
from kvxfer.geometry.checksum import block_checksum
from kvxfer.tiers.object.client import object_name
from kvxfer.tiers.object.settings import ObjectSettings
from kvxfer.tiers.object.store import ObjectTier
from kvxfer.tiers.record import MAC_BYTES
from tests.conftest import ROOT
from tests.e2e.conftest import SMALL_POOL
from kvxfer.bench.s3_server import S3Server
from tests.e2e.test_remote import offload, restore

pytestmark = pytest.mark.e2e
KEYS = [b"o%02d" % i for i in range(48)]  # the host tier holds 32 blocks of 16 KiB: the first 16 go down


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.close()


def _node(s3: S3Server, tmp_path, prefix: str, wait: bool = True, **extra) -> launch.DaemonProcess:
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-at-least-16-bytes\n")
    section = {"url": f"s3://{s3.bucket}/{prefix}", "endpoint": s3.endpoint, "allow_http": True,
               "timeout_ms": 1000, "secret_file": str(secret), **extra}
    return launch.spawn({"grace_period_s": 5, "pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "object": section},
                        wait=wait, env=s3.env)


def _tiers(daemon, keys: list[bytes]) -> list:
    with Client(daemon.target) as client:
        return client.lookup(keys, pool_ids=["rank0"]).tiers


def _events(daemon) -> dict:
    with Client(daemon.target) as client:
        (tier,) = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.OBJECT]
        return {**tier.events, "degraded": tier.degraded}


def _until(check, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_node_restores_bit_exact_what_another_demoted_to_the_bucket_and_deletes_stick(s3, tmp_path):
    a, b = _node(s3, tmp_path, "shared"), _node(s3, tmp_path, "shared")
    try:
        shadow = offload(a, KEYS)
        _until(lambda: _tiers(b, KEYS[:16]) == [TierKind.OBJECT] * 16, "b sees what a demoted")
        outcomes, blocks = restore(b, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8
        assert all(data.equal(shadow[key]) for key, data in zip(KEYS[:8], blocks))
        with Client(a.target) as client:
            assert client.delete(KEYS[8:10]) == 2  # in the bucket: gone for every node
        assert _tiers(b, KEYS[8:11]) == [None, None, TierKind.OBJECT]
        assert _events(a)["stored"] >= 16 and _events(b)["promoted"] == 8
        names = s3.objects()
        assert len([n for n in names if n.startswith("shared/")]) >= 14 and all("/rank0/" in n for n in names
                                                                              if n.startswith("shared/"))
    finally:
        a.cleanup()
        b.cleanup()


def test_forged_truncated_and_foreign_objects_are_never_served(s3, tmp_path):
    daemon = _node(s3, tmp_path, "attacked")
    try:
        offload(daemon, KEYS[:40])  # 8 demoted
        _until(lambda: _events(daemon).get("stored", 0) >= 8, "demoted")
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
        assert _events(daemon)["corrupt"] == 4
        assert not {name(k) for k in KEYS[:4]} & set(s3.objects())  # deleted from the bucket
        assert _tiers(daemon, KEYS[:4]) == [None] * 4
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


def test_a_stalled_server_is_a_miss_within_the_deadline_and_the_host_path_goes_on(s3, tmp_path):
    daemon = _node(s3, tmp_path, "stalled")
    try:
        offload(daemon, KEYS[:40])
        _until(lambda: _events(daemon).get("stored", 0) >= 8, "demoted")
        s3.pause()
        try:
            start = time.monotonic()
            assert _tiers(daemon, KEYS[:8]) == [None] * 8  # asked, not answered: misses
            assert time.monotonic() - start < 15  # (a hang guard: the deadline is 1 s)
            assert daemon.health() == 1  # SERVING
            offload(daemon, [b"during%d" % i for i in range(8)])  # the host tier takes them meanwhile
            assert _events(daemon)["degraded"]
        finally:
            s3.resume()
        _until(lambda: _tiers(daemon, KEYS[:8]) == [TierKind.OBJECT] * 8, "served again after the backoff")
    finally:
        daemon.cleanup()


def test_a_restarted_daemon_finds_what_it_wrote_in_the_bucket(s3, tmp_path):
    daemon = _node(s3, tmp_path, "warm")
    try:
        shadow = offload(daemon, KEYS[:40])
        _until(lambda: _events(daemon).get("stored", 0) >= 8, "demoted")
    finally:
        daemon.cleanup()
    restarted = _node(s3, tmp_path, "warm")
    try:
        assert _tiers(restarted, KEYS[:8]) == [TierKind.OBJECT] * 8
        outcomes, blocks = restore(restarted, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
    finally:
        restarted.cleanup()


@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials", "no server"])
def test_a_start_the_bucket_would_refuse_is_refused_in_one_line(s3, tmp_path, case):
    extra = {"missing bucket": {"url": "s3://no-such-bucket/p"}, "no server": {"endpoint": "http://127.0.0.1:1"},
             "wrong credentials": {}}[case]
    env = {**s3.env, "AWS_SECRET_ACCESS_KEY": "wrong"} if case == "wrong credentials" else s3.env
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-at-least-16-bytes\n")
    section = {"url": f"s3://{s3.bucket}/p", "endpoint": s3.endpoint, "allow_http": True, "timeout_ms": 1000,
               **extra}
    daemon = launch.spawn({"pools": [SMALL_POOL], "object": section}, wait=False, env=env)
    config = tmp_path / "check.yaml"
    config.write_text(yaml.safe_dump({"pools": [SMALL_POOL], "object": section}))
    check = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--check", "--config", str(config)],
                           env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, timeout=120)
    why = {"missing bucket": "does not exist", "wrong credentials": "credentials were refused",
           "no server": "did not answer"}[case]
    try:
        assert daemon.proc.wait(60) != 0
        log = daemon.log_text()
        assert "object" in log and "Traceback" not in log and why in log
        assert check.returncode != 0 and why in check.stderr + check.stdout  # serve --check says it too
        assert "Traceback" not in check.stderr
    finally:
        daemon.cleanup()


def _tier(s3: S3Server, monkeypatch, prefix: str, **settings) -> ObjectTier:
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return ObjectTier(ObjectSettings(f"s3://{s3.bucket}/{prefix}", s3.endpoint, allow_http=True, **settings), "g",
                      b"f" * 32, 4096)


def _block(seed: int) -> tuple[int, torch.Tensor]:
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return block_checksum(data.numpy()), data


def test_writers_of_one_key_at_once_never_clobber_each_other(s3, monkeypatch):
    tiers = [_tier(s3, monkeypatch, "race", timeout_s=10.0) for _ in range(8)]
    blocks = [_block(i) for i in range(8)]
    start = threading.Barrier(len(tiers))

    def store(i: int) -> None:
        start.wait()
        tiers[i].stage("ns", [(b"same", *blocks[i])])

    threads = [threading.Thread(target=store, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(t.flush(30) for t in tiers)
    events = [t.stats().events for t in tiers]
    # (SeaweedFS queues conditional puts of one name for about a second each: a loser may time out, a drop)
    losers = sum(e.get("already_present", 0) + e.get("stores_dropped", 0) for e in events)
    assert sum(e.get("stored", 0) for e in events) == 1 and losers == 7
    (winner,) = [i for i, e in enumerate(events) if e.get("stored")]
    fetch = tiers[0].fetch("ns", [b"same"])
    out = torch.empty(4096, dtype=torch.uint8)
    assert fetch.read([(0, out)]) == [(Outcome.DONE, blocks[winner][0])] and out.equal(blocks[winner][1])
    for t in tiers:
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
        _until(lambda: _tiers(good, KEYS[:8]) == [TierKind.OBJECT] * 8, "stored with the file's credentials")
        outcomes, blocks = restore(good, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
        assert wrong.proc.wait(60) != 0 and "credentials were refused" in wrong.log_text()
    finally:
        good.cleanup()
        wrong.cleanup()


def test_a_slow_server_behind_a_proxy_is_a_miss_within_the_deadline_and_then_serves_again(s3, tmp_path):
    from tests.e2e.slow_proxy import SlowProxy

    proxy = SlowProxy(("127.0.0.1", s3.ports["s3"]))
    daemon = _node(s3, tmp_path, "slow", endpoint=proxy.url)
    try:
        offload(daemon, KEYS[:40])
        _until(lambda: _events(daemon).get("stored", 0) >= 8, "demoted")
        proxy.delay_s = 3.0  # every byte held longer than timeout_ms
        start = time.monotonic()
        assert _tiers(daemon, KEYS[:8]) == [None] * 8
        assert time.monotonic() - start < 15  # (a hang guard: the deadline is 1 s)
        assert daemon.health() == 1
        offload(daemon, [b"slow%d" % i for i in range(8)])  # the host path goes on
        assert _events(daemon)["degraded"]
        proxy.delay_s = 0.0
        _until(lambda: _tiers(daemon, KEYS[:8]) == [TierKind.OBJECT] * 8, "served again after the backoff")
    finally:
        daemon.cleanup()
        proxy.close()


def test_a_killed_server_restarted_serves_what_it_held_and_nothing_waited_meanwhile(tmp_path):
    server = S3Server()
    daemon = _node(server, tmp_path, "killed")
    try:
        shadow = offload(daemon, KEYS[:40])
        _until(lambda: _events(daemon).get("stored", 0) >= 8, "demoted")
        server.stop()
        start = time.monotonic()
        assert _tiers(daemon, KEYS[:8]) == [None] * 8  # refused: a miss at once
        offload(daemon, KEYS[40:48])  # evictions meanwhile: dropped and counted, never waited for
        assert time.monotonic() - start < 30  # (a hang guard)
        _until(lambda: _events(daemon).get("stores_dropped", 0) > 0, "drops counted")
        server.start()
        _until(lambda: _tiers(daemon, KEYS[:8]) == [TierKind.OBJECT] * 8, "the restarted server's objects")
        outcomes, blocks = restore(daemon, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
    finally:
        daemon.cleanup()
        server.close()


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
