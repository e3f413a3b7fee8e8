"""A peer that dies, stalls, lies, or was never invited: misses within the deadline, never wrong bytes."""

import signal
import threading
import time

import grpc
import numpy as np
import pytest

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import Outcome, TierKind
from tests.peering.cluster import TOKEN, block, client, fill, keys
from tests.peering.rogue import Rogue, flip_byte

pytestmark = pytest.mark.e2e
BIG_POOL = {"id": "rank0", "device": "cpu", "layout": "BLHNC",
            "spec": {"num_layers": 8, "num_blocks": 128, "block_size": 16, "num_kv_heads": 8, "head_size": 128,
                     "dtype": "float16"},  # 512 KiB blocks: 120 of them take a few hundred ms over TCP here
            "host_capacity_mib": 72}
N = 120


def _restore_signalling_mid_read(d, b, ks, signum) -> dict:
    """B restores ``ks`` (only A holds them); A gets ``signum`` as soon as B started reading from it.
    Returns B's result and how long its restore took."""
    outcome = {}

    def restore():
        start = time.monotonic()
        outcome["result"] = b.restore(list(zip(ks, range(1, len(ks) + 1))), partial=True)
        outcome["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=restore)
    worker.start()
    deadline = time.monotonic() + 10
    while '"msg": "peer read"' not in d["b"].log_text():
        assert time.monotonic() < deadline, "no read started"
    d["a"].proc.send_signal(signum)
    worker.join(30)
    return outcome


def _peer_stats(c):
    return next(t for t in c.stats()[0].tiers if t.tier is TierKind.PEER).events


def _offload_on_a(a, n, prefix, slots=None):
    slots = slots or list(range(1, n + 1))
    written = fill(a, slots, seed=len(prefix))
    ks = keys(prefix, n)
    a.offload(list(zip(slots, ks)))
    return ks, written


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_peer_killed_or_stalled_mid_read_is_a_miss_within_the_deadline(cluster, how):
    d = cluster(["a", "b"], "tcp", pools={"a": BIG_POOL, "b": BIG_POOL}, host_share=0.9, timeout_ms=1500, lease_ms=10_000)
    with client(d["a"]) as a, client(d["b"], timeout=30) as b:
        ks, _ = _offload_on_a(a, N, f"kill-{how.name}")
        outcome = _restore_signalling_mid_read(d, b, ks, how)
        try:
            assert outcome["result"].outcomes == [Outcome.NOT_FOUND] * N  # misses, nothing partial
            assert outcome["seconds"] < 1.5 + 1.0
            assert b.lookup(ks).hits == 0  # nothing was published
            events = _peer_stats(b)
            assert events.get("failed_timeout", 0) + events.get("failed_transfer", 0) >= 1
        finally:
            if how is signal.SIGSTOP:
                d["a"].proc.send_signal(signal.SIGCONT)


def test_a_flipped_byte_on_the_peer_is_data_loss_and_nothing_is_published(cluster, tls):
    d = cluster(["a", "b"], also=("rogue",))
    rogue = Rogue("rogue", d["a"].config["listen"], tls)
    with client(d["a"]) as a, client(d["b"]) as b:
        ks, written = _offload_on_a(a, 4, "flip")
        rogue.connect()
        lease = rogue.call("PeerLease", namespace="peers", block_format=_format(d, a), keys=ks[1:2], lease_ms=1000)
        rogue.call("PeerRelease", lease_id=lease.lease_id)
        flip_byte(d["a"].proc.pid, lease.blocks[0].address + 100)
        result = b.restore(list(zip(ks, range(20, 24))), partial=True)
        assert result.outcomes == [Outcome.DONE, Outcome.DATA_LOSS, Outcome.DONE, Outcome.DONE]
        assert block(b, 20).equal(written[1]) and block(b, 22).equal(written[3])
        assert b.lookup(ks[1:2]).hits == 0  # not published here, and dropped there (bad there too)
        assert a.lookup(ks[1:2]).hits == 0 and a.lookup(ks[2:]).hits == 2
        assert _peer_stats(b)["failed_corrupt"] == 1
    rogue.close()


def _format(d, c) -> bytes:
    """The block format fingerprint of A's pool (what B sends), computed as the daemon does."""
    from kvxfer.serving.group import BlockFormat
    return BlockFormat.of(c.map_pool().layout).fingerprint


def test_only_configured_authenticated_peers_over_tls_are_served(cluster, tls):
    d = cluster(["a"], also=("friend",))
    address = d["a"].config["listen"]
    with client(d["a"]) as a:
        ks, _ = _offload_on_a(a, 2, "auth")
        fmt = _format(d, a)
    cases = [(Rogue("friend", address, tls, token="wrong-token"), grpc.StatusCode.UNAUTHENTICATED),
             (Rogue("stranger", address, tls), grpc.StatusCode.PERMISSION_DENIED),
             # The token alone no longer names a peer: a certificate of another name poses as "friend" in vain.
             (Rogue("friend", address, tls, identity="stranger"), grpc.StatusCode.PERMISSION_DENIED)]
    for rogue, code in cases:
        for method, fields in (("PeerConnect", {"agent_metadata": b"x"}),
                               ("PeerLease", {"namespace": "peers", "block_format": fmt, "keys": ks, "lease_ms": 100}),
                               ("PeerLookup", {"namespace": "peers", "block_format": fmt, "keys": ks})):
            with pytest.raises(grpc.RpcError) as err:
                rogue.call(method, **fields)
            assert err.value.code() == code
        rogue.close()
    # Without a client certificate the TLS handshake itself fails.
    bare = Rogue("friend", address, tls, certificate=False)
    with pytest.raises(grpc.RpcError) as err:
        bare.call("PeerLookup", namespace="peers", block_format=fmt, keys=ks)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    bare.close()
    # The Unix socket (where the engine talks) does not serve peers, even with the token.
    with grpc.insecure_channel(d["a"].target) as channel:
        from kvxfer.v1 import kvxfer_pb2 as pb
        from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KVPeerStub(channel).PeerLookup(pb.PeerLookupRequest(peer="friend", namespace="peers",
                                                                       block_format=fmt, keys=ks),
                                                  metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_peer_reads_only_what_its_lease_exposes_and_leases_end_on_time(cluster, tls):
    d = cluster(["a"], also=("friend",))
    rogue = Rogue("friend", d["a"].config["listen"], tls)
    with client(d["a"]) as a:
        ks, written = _offload_on_a(a, 4, "lease")
        rogue.connect()
        lease = rogue.call("PeerLease", namespace="peers", block_format=_format(d, a), keys=ks[:2], lease_ms=500)
        assert [b.position for b in lease.blocks] == [0, 1]
        nbytes = lease.block_bytes
        state, data = rogue.read("a", [lease.blocks[0].address], nbytes, lease.memory_metadata)
        assert state == "DONE" and data.tobytes() == written[1].numpy().tobytes()
        other = rogue.call("PeerLease", namespace="peers", block_format=_format(d, a), keys=ks[2:3], lease_ms=100)
        rogue.call("PeerRelease", lease_id=other.lease_id)
        beyond = max(b.address for b in lease.blocks) + 4 * nbytes
        assert rogue.read("a", [beyond], nbytes, b"")[0] == "REFUSED"  # never exposed
        assert a.stats()[0].tiers[0].pinned_blocks == 2
        time.sleep(0.8)  # the lease ends unreleased: unpinned there
        assert a.stats()[0].tiers[0].pinned_blocks == 0
        assert rogue.call("PeerRelease", lease_id=lease.lease_id).released is False
    rogue.close()


def test_a_lease_expiring_mid_read_is_a_miss_not_data_loss(cluster):
    """A stalls mid-read past the lease (its own timer stalls too): B stops at the lease's end, well
    before its 10 s timeout, and publishes nothing; A, resumed, ends the lease and loses nothing."""
    d = cluster(["a", "b"], "tcp", pools={"a": BIG_POOL, "b": BIG_POOL}, host_share=0.9, timeout_ms=10_000, lease_ms=400)
    with client(d["a"]) as a, client(d["b"], timeout=30) as b:
        ks, _ = _offload_on_a(a, N, "expiry")
        outcome = _restore_signalling_mid_read(d, b, ks, signal.SIGSTOP)
        d["a"].proc.send_signal(signal.SIGCONT)
        assert outcome["seconds"] < 2.0
        assert set(outcome["result"].outcomes) == {Outcome.NOT_FOUND}
        assert _peer_stats(b)["failed_lease_expired"] >= 1
        assert set(b.lookup(ks).tiers) == {TierKind.PEER}  # none published here: still only on A
        assert a.lookup(ks).hits == N  # A lost nothing
        time.sleep(0.6)
        assert a.stats()[0].tiers[0].pinned_blocks == 0


def test_a_push_to_a_dead_or_unknown_peer_fails_fast_and_changes_nothing(cluster):
    d = cluster(["a"], also=("gone",), timeout_ms=1000)
    with client(d["a"]) as a:
        ks, _ = _offload_on_a(a, 3, "push-dead")
        assert a.push(ks, "gone", partial=True).outcomes == [Outcome.FAILED] * 3  # (a hang: the call's deadline)
        with pytest.raises(InvalidArgument, match="not one of peering.peers"):
            a.push(ks, "nobody")
        assert a.lookup(ks).hits == 3 and a.stats()[0].tiers[0].pinned_blocks == 0


def test_a_pushed_block_is_published_only_if_its_bytes_match(cluster, tls):
    """A hand-written peer reserves slots on A, writes bytes and commits checksums, right and wrong;
    a reservation never committed ends unpublished at its deadline."""
    d = cluster(["a"], also=("friend",))
    rogue = Rogue("friend", d["a"].config["listen"], tls)
    with client(d["a"]) as a:
        fmt = _format(d, a)
        ks = keys("pushed", 3)
        rogue.connect()
        r = rogue.call("PeerReserve", namespace="peers", block_format=fmt, keys=ks[:2], lease_ms=5000)
        assert [b.position for b in r.blocks] == [0, 1] and a.lookup(ks[:2]).hits == 0  # invisible until commit
        data = np.random.default_rng(1).integers(0, 256, 2 * r.block_bytes, dtype=np.uint8)
        state, _ = rogue.xfer("WRITE", "a", [b.address for b in r.blocks], r.block_bytes, r.memory_metadata, data)
        assert state == "DONE"
        from kvxfer.geometry.block_checksum import rows_checksums
        right = rows_checksums([data[:r.block_bytes], data[r.block_bytes:]])
        stored = rogue.call("PeerCommit", reservation_id=r.reservation_id, checksums=[right[0], right[1] ^ 1]).stored
        assert list(stored) == [True, False]
        assert a.lookup(ks[:2]).tiers == [TierKind.HOST, None]
        assert a.restore([(ks[0], 5)]).outcomes == [Outcome.DONE]
        assert block(a, 5).numpy().tobytes() == data[:r.block_bytes].tobytes()
        late = rogue.call("PeerReserve", namespace="peers", block_format=fmt, keys=ks[2:], lease_ms=300)
        assert a.stats()[0].tiers[0].pinned_blocks == 1
        time.sleep(0.6)
        assert a.stats()[0].tiers[0].pinned_blocks == 0 and a.lookup(ks[2:]).hits == 0
        assert list(rogue.call("PeerCommit", reservation_id=late.reservation_id, checksums=[0]).stored) == []
    rogue.close()
