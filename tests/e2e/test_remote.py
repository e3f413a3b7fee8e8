"""The remote tier with a real redis-server and two daemons (two nodes) sharing it."""

import time

import pytest
import torch
import yaml

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.records import Outcome, TierKind
from kvxfer.events.event_records import EventKind, Reason
from service import config as service_config
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import REDIS, RedisServer
from tests.helpers import read_block, write_block

pytestmark = pytest.mark.skipif(REDIS is None, reason="needs Debian's redis-server (.ci/run installs it)")
BLOCKS = range(1, SMALL_POOL["spec"]["num_blocks"])
HOST_BLOCKS = 32  # host_capacity_mib 0.5 of 16 KiB blocks


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    s.close()


@pytest.fixture
def nodes(server):
    """Node A with write-through and node B, sharing the server."""
    a, b = node(server, write_through=True), node(server)
    yield a, b
    a.cleanup()
    b.cleanup()


def node(server: RedisServer, **remote) -> launch.DaemonProcess:
    return launch.spawn({"grace_period_s": 5, "log_level": "info",
                         "pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "remote": server.config(**remote)})


def offload(daemon, keys: list[bytes]) -> dict[bytes, torch.Tensor]:
    """Store blocks of random content under keys; returns the content of each."""
    shadow = {}
    with Client(daemon.target) as client:
        pool = client.map_pool("rank0")
        for i, key in enumerate(keys):
            block = BLOCKS[i % len(BLOCKS)]
            data = torch.randint(0, 256, (pool.layout.block_bytes,), dtype=torch.uint8)
            write_block(pool.storage, pool.layout, block, data)
            assert client.offload([(block, key)], pool_id="rank0").outcomes == [Outcome.DONE]
            shadow[key] = data
    return shadow


def restore(daemon, keys: list[bytes]) -> tuple[list[Outcome], list[torch.Tensor]]:
    with Client(daemon.target, timeout=10) as client:
        pool = client.map_pool("rank0")
        result = client.restore([(k, BLOCKS[i]) for i, k in enumerate(keys)], pool_id="rank0", partial=True)
        return result.outcomes, [read_block(pool.storage, pool.layout, BLOCKS[i]) for i in range(len(keys))]


def remote_events(daemon) -> dict:
    with Client(daemon.target) as client:
        (remote,) = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.REMOTE]
        return {**remote.events, "degraded": remote.degraded}


def refused_quickly(daemon, stored: bytes, looked_up: bytes) -> str:
    """An offload and a lookup (a miss) of a daemon whose Redis refuses it answer within 3 s, and
    the refusal is logged (by the tier's writer thread, soon after); returns the log."""
    offload(daemon, [stored])
    with Client(daemon.target) as client:  # (a call waiting on the refusing Redis: its deadline)
        assert client.lookup([looked_up], pool_ids=["rank0"]).hits == 0
    deadline = time.monotonic() + 10
    while "remote tier unavailable" not in (log := daemon.log_text()):
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.05)
    return log


def wait_stored(daemon, n: int) -> None:
    deadline = time.monotonic() + 20
    while remote_events(daemon).get("stored", 0) < n:
        assert time.monotonic() < deadline, remote_events(daemon)
        time.sleep(0.05)


def test_another_node_restores_what_this_one_evicted_bit_exact(server):
    a, b = node(server), node(server)
    try:
        keys = [b"blk%03d" % i for i in range(60)]
        shadow = offload(a, keys)  # 60 blocks through a host tier of 32: the oldest go to Redis
        wait_stored(a, 60 - HOST_BLOCKS)
        with Client(b.target) as client:
            tiers = client.lookup(keys, pool_ids=["rank0"]).tiers
        remote = [k for k, t in zip(keys, tiers) if t is TierKind.REMOTE]
        assert len(remote) == 60 - HOST_BLOCKS and tiers[-1] is None  # B sees A's evicted blocks only
        outcomes, got = restore(b, remote[:16])
        assert outcomes == [Outcome.DONE] * 16
        assert all(torch.equal(g, shadow[k]) for g, k in zip(got, remote))
        with Client(b.target) as client:  # ... and now holds them in its own host tier
            assert client.lookup(remote[:16], pool_ids=["rank0"]).tiers == [TierKind.HOST] * 16
    finally:
        a.cleanup()
        b.cleanup()


def test_write_through_shows_hot_blocks_to_other_nodes_before_any_eviction(nodes):
    a, b = nodes
    shadow = offload(a, [b"hot%d" % i for i in range(4)])
    wait_stored(a, 4)
    outcomes, got = restore(b, list(shadow))
    assert outcomes == [Outcome.DONE] * 4 and all(torch.equal(g, s) for g, s in zip(got, shadow.values()))


def test_a_flipped_byte_in_redis_is_data_loss_and_the_value_is_deleted(server, nodes):
    a, b = nodes
    offload(a, [b"victim"])
    wait_stored(a, 1)
    client = server.client()
    (name,) = [k for k in client.keys("*") if k.endswith(b"victim")]
    value = client.get(name)
    client.setrange(name, len(value) - 100, bytes([value[-100] ^ 0xFF]))
    outcomes, _ = restore(b, [b"victim"])
    assert outcomes == [Outcome.DATA_LOSS] and client.exists(name) == 0
    assert remote_events(b)["corrupt"] == 1


def test_redis_down_costs_hits_not_latency_and_its_return_is_picked_up(server):
    a = node(server, write_through=True)
    try:
        offload(a, [b"before"])
        wait_stored(a, 1)
        server.kill()
        with Client(a.target, timeout=30) as client:
            for i in range(20):  # local tiers keep serving; lookups of remote keys miss (the breaker: no wait)
                tiers = client.lookup([b"before", b"never-%d" % i], pool_ids=["rank0"]).tiers
                assert tiers[1] is None and tiers[0] is not TierKind.REMOTE
        shadow = offload(a, [b"during"])
        assert restore(a, [b"during"])[0] == [Outcome.DONE]
        events = remote_events(a)
        assert events["degraded"] and events.get("stores_dropped", 0) >= 1
        server.start()  # the same port again
        deadline = time.monotonic() + 40
        while True:  # after the breaker's backoff, the next call gets through
            offload(a, [b"after-%f" % time.monotonic()])
            if not remote_events(a)["degraded"]:
                break
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert shadow
    finally:
        a.cleanup()


def test_values_redis_evicts_are_misses_not_errors(server):
    small = RedisServer(maxmemory="4mb")
    a, b = node(small, write_through=True), node(small)
    try:
        keys = [b"m%03d" % i for i in range(400)]  # 6.4 MB of blocks into 4 MB of Redis
        offload(a, keys)
        deadline = time.monotonic() + 30
        while sum(remote_events(a).get(e, 0) for e in ("stored", "stores_dropped")) < 400:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with Client(b.target) as client:
            tiers = client.lookup(keys, pool_ids=["rank0"]).tiers
        present = [k for k, t in zip(keys, tiers) if t is TierKind.REMOTE]
        assert 0 < len(present) < 400 and small.client().info("stats")["evicted_keys"] > 0
        outcomes, _ = restore(b, keys[:16])
        assert set(outcomes) <= {Outcome.DONE, Outcome.NOT_FOUND}
        assert not remote_events(b)["degraded"]
    finally:
        a.cleanup()
        b.cleanup()
        small.close()


def test_a_wrong_password_is_a_clear_refusal_not_a_hang(server, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    a = launch.spawn({"pools": [SMALL_POOL], "log_level": "info",
                      "remote": {**server.config(write_through=True), "password_file": str(wrong)}})
    try:
        log = refused_quickly(a, b"x", b"y")
        assert "WRONGPASS" in log or "Authentication" in log
        assert "not-the-password" not in log  # never echoed
    finally:
        a.cleanup()


def test_tls_only_redis_works_over_tls_and_refuses_plaintext_quickly():
    tls = RedisServer(tls=True)
    try:
        a, b = node(tls, write_through=True), None
        try:
            shadow = offload(a, [b"secure"])
            wait_stored(a, 1)
            b = node(tls)
            outcomes, got = restore(b, [b"secure"])
            assert outcomes == [Outcome.DONE] and torch.equal(got[0], shadow[b"secure"])
        finally:
            a.cleanup()
            if b is not None:
                b.cleanup()
        plain = {**tls.config(write_through=True), "url": tls.url.replace("rediss://", "redis://")}
        plain.pop("tls_ca")
        c = launch.spawn({"pools": [SMALL_POOL], "log_level": "info", "remote": plain})
        try:
            refused_quickly(c, b"clear", b"secure")  # in Redis, but not over plaintext
        finally:
            c.cleanup()
    finally:
        tls.close()


@pytest.mark.parametrize("remote, message", [
    ({"url": "http://x"}, "remote.url"),
    ({"url": "redis://user:pw@host:6379"}, "no credentials"),
    ({"url": "redis://h:1", "timeout_ms": 0}, "timeout_ms"),
    ({"url": "redis://h:1", "tls_ca": "/etc/hostname"}, "not rediss"),
    ({"url": "redis://h:1", "password_file": "/nonexistent"}, "password_file"),
    ({"url": "redis://h:1", "write_through": "yes"}, "write_through"),
    ({"url": "redis://h:1", "mac": "sha1"}, "remote.mac: one of hmac-sha256, blake3"),
])
def test_remote_settings_are_validated(tmp_path, remote, message):
    path = tmp_path / "kvxfer.yaml"
    path.write_text(yaml.safe_dump({"remote": remote}))
    with pytest.raises(service_config.ConfigError, match=message):
        service_config.load(str(path), env={})


def test_redis_cluster_shares_blocks_across_nodes():
    from tests.e2e.redis_server import RedisClusterServers

    cluster = RedisClusterServers()
    try:
        a, b = node(cluster, write_through=True), node(cluster)
        try:
            keys = [b"c%02d" % i for i in range(24)]  # spread over the three nodes' slots
            shadow = offload(a, keys)
            wait_stored(a, 24)
            outcomes, got = restore(b, keys[:16])
            assert outcomes == [Outcome.DONE] * 16 and all(torch.equal(g, shadow[k]) for g, k in zip(got, keys))
            spread = [n.client().dbsize() for n in cluster.nodes]
            assert sum(spread) == 24 and all(spread)  # every node holds some
        finally:
            a.cleanup()
            b.cleanup()
    finally:
        cluster.close()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_daemon_starts_and_serves_while_redis_is_down(tmp_path, scheme):
    from tests.e2e.redis_server import free_port

    password = tmp_path / "password"
    password.write_text("pw\n")
    daemon = launch.spawn({"pools": [SMALL_POOL], "log_level": "info",
                           "remote": {"url": f"{scheme}://127.0.0.1:{free_port()}", "username": "u",
                                      "password_file": str(password), "write_through": True}})
    try:
        shadow = offload(daemon, [b"local"])
        outcomes, got = restore(daemon, [b"local"])
        assert outcomes == [Outcome.DONE] and torch.equal(got[0], shadow[b"local"])
        deadline = time.monotonic() + 10  # the write-through is sent (and fails) on the tier's writer thread
        while not remote_events(daemon)["degraded"]:
            assert time.monotonic() < deadline, remote_events(daemon)
            time.sleep(0.05)
    finally:
        daemon.cleanup()


def test_a_deleted_key_never_comes_back_from_the_write_queue(server):
    """Issue 30, item 2, the Redis path: a block queued for Redis before a Delete of its key was
    SET after the DEL, and every node found it again. Both orders: the Delete while the write is
    queued (the write is dropped), and while it is being sent (the Delete waits, then removes it)."""
    import threading

    from kvxfer.tiers.remote.settings import RemoteSettings
    from kvxfer.tiers.remote.store import RemoteStore
    from tests.e2e.redis_server import PASSWORD, USER

    store = RemoteStore(RemoteSettings(server.url, username=USER, password=PASSWORD, timeout_s=2), "g",
                        b"f" * 16, 64)
    held = {"_write": threading.Event(), "_send": threading.Event()}
    entered, release = {k: threading.Event() for k in held}, held

    def hold(name):
        real = getattr(store, name)

        def wrapper(batch):
            entered[name].set()
            release[name].wait(10)
            real(batch)
        return wrapper

    blocks = [(b"k%d" % i, 0, torch.full((64,), i, dtype=torch.uint8)) for i in range(4)]
    store.queue._write = hold("_write")  # the writer has the batch, not yet the lock
    store.stage("ns", blocks[:2])
    assert entered["_write"].wait(10)
    store.delete("ns", [b"k0"])  # does not wait: nothing is being sent
    release["_write"].set()
    store.flush(10)
    deadline = time.monotonic() + 10
    while store.events["stored"] + store.events["deleted_while_queued"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.contains("ns", [b"k0", b"k1"]) == [False, True] and store.events["deleted_while_queued"] == 1

    store._send = hold("_send")  # now held while sending, the lock taken
    store.stage("ns", blocks[2:])
    assert entered["_send"].wait(10)
    deleter = threading.Thread(target=store.delete, args=("ns", [b"k2"]))
    deleter.start()  # waits for the SET in flight, then removes it
    time.sleep(0.2)
    assert deleter.is_alive()
    release["_send"].set()
    deleter.join(10)
    while store.events["stored"] < 3 and time.monotonic() < deadline + 10:  # k1, then k2 (removed) and k3
        time.sleep(0.01)
    assert store.contains("ns", [b"k2", b"k3"]) == [False, True] and len(store.tombstones) == 0
    store.close(5)


def test_values_redis_evicts_or_expires_are_announced_when_redis_notifies():
    """Issue 33: Redis's own removals (maxmemory evictions, expiries) as REMOVED events of the remote
    tier, where the server publishes its keyspace notifications (notify-keyspace-events Exe)."""
    small = RedisServer(maxmemory="4mb", notify="Exe")
    a = node(small, write_through=True)
    watcher = Client(a.target, timeout=10)
    try:
        time.sleep(0.5)  # the daemon subscribes on its own thread
        keys = [b"e%03d" % i for i in range(400)]  # 6.4 MB of blocks into 4 MB of Redis
        offload(a, keys)
        name = b"\0".join([b"kvxfer:rank0", b"default", b"e399"])  # a value Redis expires on its own
        written = time.monotonic() + 30
        while not small.client().exists(name):  # (written through in the background: on a busy machine, later)
            assert time.monotonic() < written, "e399 never reached Redis"
            time.sleep(0.05)
        assert small.client().pexpire(name, 50)
        evicted, expired = set(), set()
        deadline = time.monotonic() + 30
        for batch in watcher.watch_events(["default"], from_sequence=1, timeout=30):
            for e in batch.events:
                if e.kind is EventKind.REMOVED and e.tier is TierKind.REMOTE:
                    (evicted if e.reason is Reason.EVICTED else expired).update(e.keys)
            if evicted and b"e399" in expired or time.monotonic() > deadline:
                break
        assert evicted and evicted <= set(keys) and small.client().info("stats")["evicted_keys"] > 0
        assert expired == {b"e399"}
        with Client(a.target) as client:
            gone = sorted(evicted)[:16]
            assert TierKind.REMOTE not in client.lookup(gone, pool_ids=["rank0"]).tiers
    finally:
        watcher.close()
        a.cleanup()
        small.close()
