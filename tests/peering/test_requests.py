"""Hostile or broken peer requests: a precise status each, nothing changed, the daemon serving on."""

import grpc
import pytest

from kvxfer.serving.group import BlockFormat
from tests.peering.cluster import client, fill, keys
from tests.peering.rogue import Rogue

pytestmark = pytest.mark.e2e
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def served(cluster, tls):
    d = cluster(["a"], also=("friend", "other"))
    with client(d["a"]) as a:
        fill(a, [1, 2, 3], seed=9)
        ks = keys("req", 3)
        a.offload(list(zip([1, 2, 3], ks)))
        fmt = BlockFormat.of(a.map_pool().layout).fingerprint
        rogue = Rogue("friend", d["a"].config["listen"], tls)
        yield d["a"], a, rogue, ks, fmt
        rogue.close()


def _status(call, **fields):
    with pytest.raises(grpc.RpcError) as err:
        call(**fields)
    return err.value.code(), err.value.details()


def test_malformed_requests_are_refused_and_change_nothing(served, tls):
    daemon, a, rogue, ks, fmt = served
    lease = lambda **f: rogue.call("PeerLease", **{"namespace": "peers", "block_format": fmt, "keys": ks,
                                                   "lease_ms": 1000, **f})
    cases = [
        (lambda: lease(block_format=b"short"), "block_format: 32 bytes"),
        (lambda: lease(namespace="bad namespace!"), "namespace"),
        (lambda: lease(keys=[b""]), "key"),
        (lambda: lease(keys=[ks[0], ks[0]]), "duplicate"),
        (lambda: lease(lease_ms=0), "lease_ms"),
        (lambda: lease(lease_ms=10**6), "lease_ms"),
        (lambda: lease(keys=[b"k%d" % i for i in range(70_000)]), "more than 65536 keys"),
        (lambda: rogue.call("PeerRelease", lease_id=b"x"), "lease_id: 16 bytes"),
        (lambda: rogue.call("PeerConnect", agent_metadata=b""), "agent_metadata"),
    ]
    for call, text in cases:
        code, details = _status(call)
        assert code == INVALID and text in details, (text, details)
    code, details = _status(lambda: rogue.call("PeerConnect", agent_metadata=b"\x00garbage" * 10))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "not NIXL agent metadata" in details
    assert a.stats()[0].tiers[0].pinned_blocks == 0
    assert a.lookup(ks).hits == 3
    assert daemon.health() == 1  # SERVING


def test_a_peer_cannot_release_or_condemn_what_it_was_not_granted(served, tls):
    daemon, a, rogue, ks, fmt = served
    rogue.connect()
    lease = rogue.call("PeerLease", namespace="peers", block_format=fmt, keys=ks[:2], lease_ms=5000)
    other = Rogue("other", daemon.config["listen"], tls)
    assert other.call("PeerRelease", lease_id=lease.lease_id).released is False  # not its lease
    assert a.stats()[0].tiers[0].pinned_blocks == 2
    code, details = _status(lambda: rogue.call("PeerRelease", lease_id=lease.lease_id, corrupt_positions=[2]))
    assert code == INVALID and "were not leased" in details
    # A reader's word alone drops nothing: the blocks are checked here and are good.
    assert rogue.call("PeerRelease", lease_id=lease.lease_id, corrupt_positions=[0, 1]).released
    assert a.lookup(ks).hits == 3 and a.stats()[0].tiers[0].pinned_blocks == 0
    other.close()


def test_lease_bounds_and_foreign_formats(served):
    daemon, a, rogue, ks, fmt = served
    rogue.connect()
    empty = rogue.call("PeerLease", namespace="peers", block_format=b"\x01" * 32, keys=ks, lease_ms=100)
    assert not empty.blocks and not empty.lease_id  # another format's blocks are never served
    assert list(rogue.call("PeerLookup", namespace="peers", block_format=b"\x01" * 32, keys=ks).present) == [False] * 3
    assert list(rogue.call("PeerLookup", namespace="other", block_format=fmt, keys=ks).present) == [False] * 3
    assert list(rogue.call("PeerLookup", namespace="peers", block_format=fmt, keys=ks).present) == [True] * 3


def test_a_peer_cannot_pin_more_than_the_bounds(cluster, tls):
    d = cluster(["a"], also=("friend",), max_leases=2, max_leased_blocks=3)
    with client(d["a"]) as a:
        fill(a, [1, 2, 3, 4], seed=9)
        ks = keys("bounds", 4)
        a.offload(list(zip([1, 2, 3, 4], ks)))
        fmt = BlockFormat.of(a.map_pool().layout).fingerprint
        rogue = Rogue("friend", d["a"].config["listen"], tls)
        rogue.connect()
        lease = lambda k: rogue.call("PeerLease", namespace="peers", block_format=fmt, keys=k, lease_ms=5000)  # noqa: E731
        first = lease(ks[:2])
        code, details = _status(lambda: lease(ks[2:]))  # 4 blocks would be pinned: at most 3
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 3" in details
        second = lease(ks[2:3])
        code, details = _status(lambda: lease(ks[3:]))  # a third lease: at most 2
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 2" in details
        assert a.stats()[0].tiers[0].pinned_blocks == 3
        for granted in (first, second):
            assert rogue.call("PeerRelease", lease_id=granted.lease_id).released
        assert a.stats()[0].tiers[0].pinned_blocks == 0 and a.lookup(ks).hits == 4
        rogue.close()
