"""Tenancy and bounds where peering meets cache groups: peers reach only the groups shared with them,
each peer holds a bounded share, the engine's own stores come first, and a bad PeerConnect cuts nothing."""

import grpc
import pytest
import torch

from kvxfer.client import Client
from kvxfer.core.records import Medium, Outcome
from kvxfer.geometry.layout import KVSpec, Layout, PoolLayout
from kvxfer.memory import shm
from kvxfer.memory.pool import Pool, PoolHandle
from kvxfer.serving.group import BlockFormat
from tests.helpers import read_block, write_block
from tests.peering.cluster import TOKEN, client, fill, keys
from tests.peering.rogue import Rogue

pytestmark = pytest.mark.e2e
SPEC = KVSpec(num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
LAYOUT = Layout.parse("BLHNC")
FORMAT = BlockFormat.of(PoolLayout(SPEC, LAYOUT)).fingerprint


def _register(daemon, group: str, **sharing) -> tuple[Client, Pool]:
    """A registered pool of its own in cache group ``group`` (a tenant's engine), its blocks 1-4 filled."""
    c = Client(daemon.target, "tenant", pool_id=group, token=TOKEN)
    fd = shm.create_sealed(group, SPEC.nbytes)
    pool = Pool.from_fd(c.register_pool(group, SPEC, LAYOUT, PoolHandle(Medium.SHM), fd=fd, cache_group=group,
                                         **sharing), fd)
    g = torch.Generator().manual_seed(len(group))
    for slot in range(1, 5):
        write_block(pool.storage, pool.layout, slot, torch.randint(0, 256, (pool.layout.block_bytes,),
                                                                   dtype=torch.uint8, generator=g))
    return c, pool


def test_peers_reach_a_registrants_group_only_when_it_is_shared_with_them(cluster, tls):
    """A pool another party registered in its own group was restored, bit-exact, by a peer; and a peer
    pushed blocks into it. Now a private group is neither read nor written by peers; a shared one is."""
    d = cluster(["a", "b"], also=("friend",))
    rogue = Rogue("friend", d["a"].config["listen"], tls)
    rogue.connect()
    ks, fresh = keys("tenant", 4), keys("planted", 2)
    (private, ppool), (shared, spool) = _register(d["a"], "tenantv"), _register(d["a"], "open", share_with_peers=True)
    try:
        for c in (private, shared):
            assert c.offload(list(zip(range(1, 5), ks))).outcomes == [Outcome.DONE] * 4
        ask = {"namespace": "tenant", "block_format": FORMAT}
        assert list(rogue.call("PeerLookup", cache_group="tenantv", keys=ks, **ask).present) == [False] * 4
        assert not rogue.call("PeerLease", cache_group="tenantv", keys=ks, lease_ms=1000, **ask).blocks
        reserved = rogue.call("PeerReserve", cache_group="tenantv", keys=fresh, lease_ms=1000, **ask)
        assert not reserved.blocks and not reserved.reservation_id  # nothing can be planted there
        assert private.lookup(fresh).hits == 0 and private.stats()[0].tiers[0].pinned_blocks == 0
        # Daemon B's engine in a group of the same name restores nothing from A's private one.
        restorer, rpool = _register(d["b"], "tenantv", share_with_peers=True)
        assert restorer.restore(list(zip(ks, range(5, 9))), partial=True).outcomes == [Outcome.NOT_FOUND] * 4
        # The group shared with peers is reached: looked up, leased, read bit-exact.
        assert list(rogue.call("PeerLookup", cache_group="open", keys=ks, **ask).present) == [True] * 4
        lease = rogue.call("PeerLease", cache_group="open", keys=ks[:1], lease_ms=20_000, **ask)
        state, data = rogue.read("a", [lease.blocks[0].address], lease.block_bytes, lease.memory_metadata)
        assert state == "DONE" and data.tobytes() == read_block(spool.storage, spool.layout, 1).numpy().tobytes()
        assert rogue.call("PeerRelease", lease_id=lease.lease_id).released
        for c, p in ((restorer, rpool), (private, ppool), (shared, spool)):
            c.close()
            p.close()
    finally:
        rogue.close()


def test_a_bad_peer_connect_changes_nothing_and_cuts_no_read(cluster, tls):
    """Garbage (or another agent's) metadata naming a connected peer dropped its live connection before
    the metadata was checked; now it is refused and the peer's reads go on."""
    d = cluster(["a"], also=("friend",))
    rogue = Rogue("friend", d["a"].config["listen"], tls)
    with client(d["a"]) as a:
        written = fill(a, [1, 2], seed=3)
        ks = keys("conn", 2)
        a.offload(list(zip([1, 2], ks)))
        fmt = BlockFormat.of(a.map_pool().layout).fingerprint
        rogue.connect()
        lease = rogue.call("PeerLease", namespace="peers", block_format=fmt, keys=ks, lease_ms=20_000)
        other_agent = b"nixlSerDes|Agent" + (5).to_bytes(8, "little") + b"other" + b"|Conns" + bytes(40)
        for metadata, text in ((b"\x00garbage" * 10, "not NIXL agent metadata"), (other_agent, "names agent 'other'"),
                               (rogue.agent.get_agent_metadata()[:40], "refused")):
            with pytest.raises(grpc.RpcError) as err:
                rogue.call("PeerConnect", agent_metadata=metadata)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and text in err.value.details()
        for i, block in enumerate(lease.blocks):  # the connection made before still carries reads
            state, data = rogue.read("a", [block.address], lease.block_bytes, lease.memory_metadata if i == 0 else b"")
            assert state == "DONE" and data.tobytes() == written[i + 1].numpy().tobytes()
        assert rogue.call("PeerRelease", lease_id=lease.lease_id).released
    rogue.close()


def test_each_peer_holds_a_bounded_share_and_the_engine_comes_first(cluster, tls):
    """One peer reserved a whole host tier (the engine lost 120 of 120 blocks, its offloads refused), and
    an uncommitted reservation made the engine's offload of the same keys ALREADY_PRESENT and then lost both."""
    d = cluster(["a"], also=("friend", "other"), max_leases_per_peer=2)
    rogue, other = Rogue("friend", d["a"].config["listen"], tls), Rogue("other", d["a"].config["listen"], tls)
    rogue.connect()
    with client(d["a"]) as a:
        capacity = a.stats()[0].tiers[0].capacity_blocks  # 2 MiB of 16 KiB blocks: 128
        share = capacity // 4  # peering.host_share 0.25
        fmt = BlockFormat.of(a.map_pool().layout).fingerprint
        written = fill(a, list(range(1, share + 1)), seed=5)
        engine = keys("engine", share)
        assert a.offload(list(zip(range(1, share + 1), engine))).outcomes == [Outcome.DONE] * share
        reserve = lambda peer, ks: peer.call("PeerReserve", namespace="peers", block_format=fmt, keys=ks,  # noqa: E731
                                             lease_ms=30_000)
        with pytest.raises(grpc.RpcError) as err:  # the whole tier: refused before anything is evicted
            reserve(rogue, keys("hoard", capacity))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "host_share" in err.value.details()
        assert a.lookup(engine).hits == share
        first = reserve(rogue, keys("pushed", share - 2))
        assert len(first.blocks) == share - 2
        with pytest.raises(grpc.RpcError) as err:  # the share is the host tier's, over every peer
            reserve(other, keys("more", 3))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reserve(rogue, keys("small", 1))
        with pytest.raises(grpc.RpcError) as err:  # a third at once: at most 2 a peer
            reserve(rogue, keys("third", 1))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "a peer" in err.value.details()
        # The engine offloads keys a peer has reserved and not committed: its store wins.
        taken = keys("pushed", 3)
        fill(a, [60, 61, 62], seed=8)
        assert a.offload(list(zip([60, 61, 62], taken))).outcomes == [Outcome.DONE] * 3
        assert a.lookup(taken).hits == 3
        assert a.stats()[0].tiers[0].used_blocks <= capacity
    # Uncommitted, the reservation ends at its deadline; the engine's copies stay, bit-exact.
    with client(d["a"]) as a:
        stored = list(rogue.call("PeerCommit", reservation_id=first.reservation_id,
                                 checksums=[0] * len(first.blocks)).stored)
        assert stored[:3] == [True] * 3 and not any(stored[3:])  # the engine holds those three; the rest: wrong
        assert a.lookup(taken).hits == 3 and a.lookup(engine).hits == share
        got = a.restore(list(zip(engine[:2], [40, 41]))).outcomes
        assert got == [Outcome.DONE] * 2
        pool = a.map_pool()
        assert torch.equal(read_block(pool.storage, pool.layout, 40), written[1])
    rogue.close()
    other.close()


def test_an_engine_over_tcp_shows_a_certificate_of_the_peers_ca(cluster, tls):
    """With peering on, the TLS listener asks every caller for a certificate: the client can show one."""
    from kvxfer.core.errors import Unavailable

    d = cluster(["a"])
    listen, ca = d["a"].config["listen"], tls.ca.read_bytes()
    cert, key = tls.issue("engine")
    with Client(listen, token=TOKEN, root_certificates=ca, certificate_chain=cert.read_bytes(),
                private_key=key.read_bytes()) as c:
        assert c.health() == "SERVING" and c.pool_info("rank0").pool_id == "rank0"
    with Client(listen, token=TOKEN, root_certificates=ca) as bare:
        with pytest.raises(Unavailable):
            bare.health()
