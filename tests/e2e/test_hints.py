"""Hints through a real daemon (over the local lane and over gRPC): released blocks are evicted first and
retained ones last, an Offload can carry its blocks' hint, a PREFETCH brings blocks up from the disk tier
before anyone asks (and a prefetch evicted unread counts as wasted), a CANCEL drops a queued prefetch, and
bad hints get a precise status and change nothing. /metrics says what the hints did."""

import threading
import time
import urllib.request

import pytest
import torch

from kvxfer.client import Client, KVSpec, Layout, PoolHandle
from kvxfer.core.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from kvxfer.core.records import HintAction, Medium, Outcome, TierKind
from kvxfer.v1 import kvxfer_pb2 as pb
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import free_port

# SMALL_POOL: 16 KiB blocks, 64 of them; a host tier of 2 MiB holds 128 blocks.


def _fill(client: Client, keys: list[bytes], first_block: int = 1) -> None:
    views = client.map_pool().views()[0][0]
    for start in range(0, len(keys), 32):
        chunk = keys[start:start + 32]
        for j in range(len(chunk)):
            views[first_block + j].fill_((start + j) % 100 + 1)
        client.offload([(first_block + j, k) for j, k in enumerate(chunk)])


def _where(client: Client, keys: list[bytes]) -> list:
    return client.lookup(keys).tiers


def _metric(port: int, name: str, labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = f"{name}{{{labels}}} " if labels else f"{name} "
    line = next((l for l in text.splitlines() if l.startswith(wanted)), None)
    assert line is not None, f"{name}{{{labels}}} not in /metrics"
    return float(line.split()[-1])


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_released_go_first_retained_last(make_daemon, lane):
    port = free_port()
    daemon = make_daemon({"metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, "app", pool_id="rank0", lane=lane) as c:
        keys = [b"k%03d" % i for i in range(128)]
        _fill(c, keys)  # the host tier is full: k000 is the least recently used
        c.hint(HintAction.RETAIN, keys[:16], ttl_s=600)
        c.hint(HintAction.RELEASE, keys[100:] + [b"never-stored"])
        _fill(c, [b"n%03d" % i for i in range(48)])  # 48 more: 28 released go, then 20 by LRU past the retained
        host = TierKind.HOST
        assert _where(c, keys[:16]) == [host] * 16
        assert _where(c, keys[16:36]) == [None] * 20
        assert _where(c, keys[36:100]) == [host] * 64
        assert _where(c, keys[100:]) == [None] * 28
    by_reason = 'cache_group="rank0",reason="{}",tier="host"'
    assert _metric(port, "kvxfer_tier_evictions_by_reason_total", by_reason.format("released")) == 28
    assert _metric(port, "kvxfer_tier_evictions_by_reason_total", by_reason.format("lru")) == 20
    assert _metric(port, "kvxfer_tier_hinted_blocks", 'cache_group="rank0",state="retained",tier="host"') == 16
    assert _metric(port, "kvxfer_hints_total", 'action="retain",cache_group="rank0"') == 1
    assert _metric(port, "kvxfer_hints_total", 'action="release",cache_group="rank0"') == 1


def test_an_offload_carries_its_blocks_hint_and_a_read_makes_a_released_block_ordinary(make_daemon):
    daemon = make_daemon()
    with Client(daemon.target, "app", pool_id="rank0") as c:
        last_turn = [b"t%03d" % i for i in range(8)]
        c.map_pool().views()[0][0][1:9].fill_(7)
        c.offload([(1 + j, k) for j, k in enumerate(last_turn)], hint=(HintAction.RELEASE, 0))
        shared = [b"s%03d" % i for i in range(4)]
        c.offload([(1 + j, k) for j, k in enumerate(shared)], hint=(HintAction.RELEASE, 0))
        assert c.restore([(shared[0], 20)]).outcomes == [Outcome.DONE]  # another session reads it: ordinary
        _fill(c, [b"k%03d" % i for i in range(127)])  # 12 stored before, 116 free: 11 go, the released ones
        assert _where(c, last_turn) == [None] * 8
        assert _where(c, shared) == [TierKind.HOST, None, None, None]
        with pytest.raises(InvalidArgument, match="RETAIN or RELEASE"):
            c.offload([(1, b"x")], hint=(HintAction.PREFETCH, 0))
        with pytest.raises(InvalidArgument, match="ttl_s 0 is out of range"):
            c.offload([(1, b"x")], hint=(HintAction.RETAIN, 0))
        assert c.lookup([b"x"]).hits == 0  # a refused offload stored nothing


def _settled(client: Client, demoted: int) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a timing
    while True:
        disk = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.DISK][0]
        if disk.events.get("demoted", 0) >= demoted and disk.pinned_blocks == 0:
            return
        assert time.monotonic() < deadline, disk
        time.sleep(0.05)


def _until_host(client: Client, keys: list[bytes]) -> None:
    deadline = time.monotonic() + 60
    while _where(client, keys) != [TierKind.HOST] * len(keys):
        assert time.monotonic() < deadline, _where(client, keys)
        time.sleep(0.05)


def test_a_prefetch_brings_blocks_up_from_disk_and_one_evicted_unread_is_wasted(make_daemon, tmp_path):
    port = free_port()
    disk = {"path": str(tmp_path / "disk"), "capacity_mib": 4}
    daemon = make_daemon({"pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "disk": disk,  # 32 host blocks
                          "metrics_listen": f"127.0.0.1:{port}", "hints": {"share": 0.5, "prefetch_batch": 4}})
    with Client(daemon.target, "app", pool_id="rank0") as c:
        keys = [b"k%03d" % i for i in range(64)]
        _fill(c, keys)  # k000-k031 went down to disk
        _settled(c, 32)
        assert _where(c, keys[:8]) == [TierKind.DISK] * 8
        c.hint(HintAction.PREFETCH, keys[:8], request_id="req-1")
        _until_host(c, keys[:8])
        views = c.map_pool().views()[0][0]
        assert c.restore([(k, 40 + j) for j, k in enumerate(keys[:4])]).outcomes == [Outcome.DONE] * 4
        assert all(bool((views[40 + j] == j + 1).all()) for j in range(4))  # bit-exact, as offloaded
        c.hint(HintAction.PREFETCH, keys[8:40], request_id="req-2")  # a share of 16: 4 of 8 left unread, 12 more
        deadline = time.monotonic() + 60
        while _metric(port, "kvxfer_prefetch_queued_keys", "") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        done = _metric(port, "kvxfer_prefetch_keys_total", 'result="done"')
        assert done == 8 + 12
        assert _metric(port, "kvxfer_prefetch_keys_total", 'result="over_share"') >= 8
        _fill(c, [b"n%03d" % i for i in range(32)])  # the whole host tier over: unread prefetched blocks go
        assert _metric(port, "kvxfer_tier_prefetch_wasted_total", 'cache_group="rank0",tier="host"') == 4 + 12


def test_cancel_drops_a_queued_prefetch(make_daemon, tmp_path):
    port = free_port()
    disk = {"path": str(tmp_path / "disk"), "capacity_mib": 4}
    daemon = make_daemon({"pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "disk": disk,
                          "metrics_listen": f"127.0.0.1:{port}", "hints": {"prefetch_batch": 1}})
    with Client(daemon.target, "app", pool_id="rank0") as c:
        keys = [b"k%03d" % i for i in range(64)]
        _fill(c, keys)
        _settled(c, 32)
        for i in range(8):  # queued behind each other, one key a batch
            c.hint(HintAction.PREFETCH, keys[4 * i:4 * i + 4], request_id=f"r{i % 2}")
        c.hint(HintAction.CANCEL, request_id="r1")
        deadline = time.monotonic() + 60
        while _metric(port, "kvxfer_prefetch_queued_keys", "") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancelled = _metric(port, "kvxfer_prefetch_keys_total", 'result="cancelled"')
        done = _metric(port, "kvxfer_prefetch_keys_total", 'result="done"')
        assert cancelled >= 12 and done + cancelled + _metric(port, "kvxfer_prefetch_keys_total",
                                                               'result="over_share"') == 32


def test_bad_hints_get_a_precise_status_and_change_nothing(make_daemon):
    daemon = make_daemon({"hints": {"max_ttl_s": 60, "prefetch_queue_keys": 16}})
    with Client(daemon.target, "app", pool_id="rank0") as c:
        keys = [b"k%03d" % i for i in range(128)]
        _fill(c, keys)
        stub = c._stub
        ref = c._ref("rank0")
        bad = [(dict(action=0, keys=keys[:1]), "hint action 0"),
               (dict(action=pb.HINT_ACTION_RETAIN, keys=keys[:1], ttl_s=0), "ttl_s 0 is out of range"),
               (dict(action=pb.HINT_ACTION_RETAIN, keys=keys[:1], ttl_s=61), "1 to 60 seconds"),
               (dict(action=pb.HINT_ACTION_RELEASE, keys=keys[:1], ttl_s=5), "takes none"),
               (dict(action=pb.HINT_ACTION_CANCEL), "request_id"),
               (dict(action=pb.HINT_ACTION_CANCEL, request_id="r", keys=keys[:1]), "no keys"),
               (dict(action=pb.HINT_ACTION_RELEASE, keys=[b"a", b"a"]), "duplicate"),
               (dict(action=pb.HINT_ACTION_RELEASE, keys=[b""]), "key"),
               (dict(action=pb.HINT_ACTION_PREFETCH, keys=keys[:1], request_id="no spaces"), "request_id")]
        for fields, words in bad:
            with pytest.raises(InvalidArgument, match=words):
                c._call(stub.Hint, pb.HintRequest(pool=ref, namespace="app", **fields))
        with pytest.raises(InvalidArgument, match="namespace"):
            c.hint(HintAction.RELEASE, keys[:1], namespace="bad namespace")
        with pytest.raises(InvalidArgument, match="at most 65536"):  # (refused by the library, before sending)
            c.hint(HintAction.RELEASE, [b"%d" % i for i in range(65537)])
        with pytest.raises(ResourceExhausted, match="at most 16"):
            c.hint(HintAction.PREFETCH, [b"q%d" % i for i in range(17)])
        for ttl in (-1, 1 << 40, 2.5, "600", None):  # the library refuses what the wire cannot carry
            with pytest.raises(InvalidArgument, match="ttl_s"):
                c.hint(HintAction.RETAIN, keys[:1], ttl_s=ttl)
        for action, words in (("keep", "hint action"), (7, "hint action")):
            with pytest.raises(InvalidArgument, match=words):
                c.hint(action, keys[:1])
        with pytest.raises(InvalidArgument, match="key"):
            c.hint(HintAction.RELEASE, ["not bytes"])
        c.hint(HintAction.RELEASE, [b"unknown-%d" % i for i in range(100)])  # unknown keys: OK, no effect
        c.hint(HintAction.RELEASE, keys[:8], namespace="another")  # another namespace's keys: OK, no effect
        _fill(c, [b"n%03d" % i for i in range(8)])
        assert _where(c, keys[:8]) == [None] * 8 and _where(c, keys[8:16]) == [TierKind.HOST] * 8  # plain LRU


def test_a_private_registered_pool_takes_hints_from_its_registrant_only(make_daemon, tmp_path):
    daemon = make_daemon()
    spec = KVSpec(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
    path = tmp_path / "engine"
    path.write_bytes(bytes(spec.nbytes))
    with Client(daemon.target, "app") as owner, Client(daemon.target, "app") as other:
        owner.register_pool("engine0", spec, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(path)))
        owner.hint(HintAction.RELEASE, [b"k"], pool_id="engine0")
        other.pool_info("engine0")
        with pytest.raises(PermissionDenied, match="registrant"):
            other.hint(HintAction.RELEASE, [b"k"], pool_id="engine0")
        # A group that shows its keys to routers (share_events) takes their hints too.
        owner.register_pool("engine1", spec, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(path)),
                            cache_group="shared-group", share_events=True)
        other.pool_info("engine1")
        other.hint(HintAction.RELEASE, [b"k"], pool_id="engine1")


def test_a_hint_storm_leaves_the_daemon_answering(make_daemon):
    daemon = make_daemon()
    with Client(daemon.target, "app", pool_id="rank0") as c:
        keys = [b"k%03d" % i for i in range(128)]
        _fill(c, keys)
        storm = [b"x%05d" % i for i in range(4096)] + keys[:64]
        stop = threading.Event()
        errors: list[BaseException] = []

        def flood() -> None:
            with Client(daemon.target, "app", pool_id="rank0", lane=False) as f:
                while not stop.is_set():
                    try:
                        f.hint(HintAction.RETAIN, storm, ttl_s=600)
                        f.hint(HintAction.RELEASE, storm)
                    except ResourceExhausted:
                        pass  # max_concurrent_rpcs: refused, the daemon fine
                    except BaseException as exc:  # noqa: BLE001 - reported below
                        errors.append(exc)
                        return

        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            for _ in range(20):  # the engine's own calls still answer, right, within their deadlines
                assert c.lookup(keys[64:]).hits == 64
                assert c.restore([(keys[100], 50)], timeout=30).outcomes == [Outcome.DONE]
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert errors == []
        assert c.health() == "SERVING"


def test_kvxfer_hint_sends_each_action_and_refuses_bad_input_in_one_line(make_daemon, tmp_path):
    import subprocess

    from tests.conftest import PYTHON, ROOT, python_env

    daemon = make_daemon()
    with Client(daemon.target, "app", pool_id="rank0") as c:
        keys = [b"k%03d" % i for i in range(128)]
        _fill(c, keys)

        def hint(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([PYTHON, "-m", "service.program", "hint", *args, "--target", daemon.target],
                                  env=python_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)

        (tmp_path / "keys").write_text("\n".join(k.hex() for k in keys[8:16]) + "\n")
        out = hint("release", "--pool", "rank0", "--namespace", "app", "--keys", *(k.hex() for k in keys[:8]),
                   "--keys-file", str(tmp_path / "keys"))
        assert out.returncode == 0 and "release: sent for 16 keys" in out.stdout, out.stderr
        assert hint("cancel", "--pool", "rank0", "--request-id", "r1").returncode == 0
        _fill(c, [b"n%03d" % i for i in range(16)])
        assert _where(c, keys[:16]) == [None] * 16 and _where(c, keys[16:32]) == [TierKind.HOST] * 16
        for args, words in [(("retain", "--pool", "rank0", "--keys", "zz"), "not hex"),
                            (("retain", "--pool", "rank0", "--ttl", "0", "--keys", "00ff"), "ttl_s 0 is out of range"),
                            (("cancel", "--pool", "rank0"), "--request-id"),
                            (("release", "--pool", "rank0"), "at least one key"),
                            (("retain", "--pool", "rank0", "--ttl", "-1", "--keys", "00ff"), "--ttl"),
                            (("retain", "--pool", "rank0", "--ttl", "1099511627776", "--keys", "00ff"), "--ttl")]:
            out = hint(*args)
            assert out.returncode == 2 and words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out


def test_a_prefetch_refused_for_a_full_queue_is_not_counted_as_a_hint_taken(make_daemon, tmp_path):
    """kvxfer_hints_total counts hints taken: a PREFETCH refused with RESOURCE_EXHAUSTED adds nothing."""
    port = free_port()
    disk = {"path": str(tmp_path / "disk"), "capacity_mib": 4}
    daemon = make_daemon({"pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "disk": disk,
                          "metrics_listen": f"127.0.0.1:{port}", "hints": {"prefetch_queue_keys": 16}})
    labels = 'action="prefetch",cache_group="rank0"'
    with Client(daemon.target, "app", pool_id="rank0") as c:
        refused = 0
        for _ in range(20):
            with pytest.raises(ResourceExhausted, match="at most 16"):
                c.hint(HintAction.PREFETCH, [b"q%02d" % i for i in range(17)])
            refused += 1
        c.hint(HintAction.PREFETCH, [b"q%02d" % i for i in range(4)])
        assert refused == 20 and _metric(port, "kvxfer_hints_total", labels) == 1
