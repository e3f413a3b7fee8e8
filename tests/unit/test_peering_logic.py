"""Issue 48: the peering logic (leases, the peer tier's reads, pushes) under unit tests that run everywhere,
two daemons' cache groups in one process joined by a fake NIXL agent (``tests/fake_nixl.py``). The
end-to-end tests with real agents are ``tests/peering``."""

import time
from types import SimpleNamespace

import pytest
import torch

from kvxfer.core.errors import ResourceExhausted
from kvxfer.core.records import Outcome
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.peering.agent import XferResult
from kvxfer.peering.counters import PeerCounters
from kvxfer.peering.leases import LeaseTable
from kvxfer.peering.push import push
from kvxfer.peering.settings import PeeringSettings
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.peer import PeerTier
from tests.fake_nixl import FakeAgent, FakeLink

SPEC = KVSpec(2, 16, 16, 2, 32, torch.float16)  # 8 KiB blocks
KEYS = [b"k%d" % i for i in range(4)]


class Node:
    """One daemon's side: a pool, its cache group, its agent, its lease table and its counters."""

    def __init__(self, fabric: dict, name: str, seed: int, **settings) -> None:
        self.pool = Pool.create(name, SPEC, Layout.parse("BLHNC"))
        self.pool.storage.copy_(torch.randint(0, 256, (self.pool.layout.nbytes,), dtype=torch.uint8,
                                              generator=torch.Generator().manual_seed(seed)))
        self.group = CacheGroup("g", self.pool.layout, 8)
        self.manager = PoolManager(self.pool, self.group)
        self.agent = FakeAgent(fabric, name)
        self.counters = PeerCounters()
        settings = {"host_share": 1.0, **settings}  # (a host tier of 8 blocks: the default quarter is 2)
        self.leases = LeaseTable(self.agent, PeeringSettings(name, **settings), lambda: [self.group], self.counters)

    def block(self, b: int) -> torch.Tensor:
        span = self.pool.layout.block_bytes
        return self.pool.storage[b * span:(b + 1) * span].clone()

    def host_bytes(self, key: bytes) -> torch.Tensor:
        return self.group.host.buffer[self.group.index.locate("ns", key)].clone()

    def close(self) -> None:
        self.leases.close()


@pytest.fixture
def nodes():
    fabric: dict = {}
    a, b = Node(fabric, "a", 1), Node(fabric, "b", 2)
    assert a.manager.offload("ns", [(i + 1, k) for i, k in enumerate(KEYS)]).outcomes == [Outcome.DONE] * 4
    yield a, b, FakeLink("b", "a", a.leases, b.agent), FakeLink("a", "b", b.leases, a.agent)
    a.close()
    b.close()


def _store(b: Node, link: FakeLink, lease_ms: int = 5000) -> PeerTier:
    """``b``'s peer tier reading from one peer, made as the tier registry makes it for a group."""
    peers = SimpleNamespace(agent=b.agent, links=[link], counters=b.counters,
                            settings=PeeringSettings("b", lease_ms=lease_ms))
    return PeerTier(peers, b.group.context)


def test_a_restore_reads_a_peers_blocks_bit_exact_and_releases_its_lease(nodes):
    a, b, b_to_a, _ = nodes
    store = _store(b, b_to_a)
    assert store.contains("ns", KEYS + [b"absent"]) == [True] * 4 + [False]
    assert b.group.promote("ns", KEYS + [b"absent"], tiers=[store]) == {}
    assert all(torch.equal(b.host_bytes(k), a.block(i + 1)) for i, k in enumerate(KEYS))
    assert b.manager.restore("ns", [(KEYS[2], 9)]).outcomes == [Outcome.DONE]  # checksums published with them
    assert torch.equal(b.block(9), a.block(3))
    assert a.leases.open == (0, 0) and a.group.index.stats().pinned == 0 and not a.agent.exposed
    assert b_to_a.released and b_to_a.released[0][1] == []


def test_bytes_changed_under_a_lease_are_data_loss_here_and_dropped_there_only_if_wrong_there(nodes):
    a, b, b_to_a, _ = nodes
    b.agent.corrupt_next = True  # the wire flips a byte: the peer's own copy is good
    failed = b.group.promote("ns", KEYS[:2], tiers=[_store(b, b_to_a)])
    assert failed == {KEYS[0]: Outcome.DATA_LOSS, KEYS[1]: Outcome.DATA_LOSS}
    assert sorted(b_to_a.released[0][1]) == [0, 1]  # reported corrupt ...
    assert a.manager.lookup("ns", KEYS[:2]).hits == 2  # ... and kept there: its bytes check out
    a.group.host.buffer[a.group.index.locate("ns", KEYS[3])][5] ^= 1  # now wrong at the peer itself
    assert b.group.promote("ns", [KEYS[3]], tiers=[_store(b, b_to_a)]) == {KEYS[3]: Outcome.DATA_LOSS}
    assert a.manager.lookup("ns", [KEYS[3]]).hits == 0  # dropped there too


@pytest.mark.parametrize("result, cause", [(XferResult.FAILED, "transfer"), (XferResult.TIMEOUT, "timeout")])
def test_a_failed_read_is_a_miss_that_disconnects_and_releases(nodes, result, cause):
    a, b, b_to_a, _ = nodes
    b.agent.fail = result
    assert b.group.promote("ns", KEYS, tiers=[_store(b, b_to_a)]) == {}  # a miss, not a failure
    assert b.manager.lookup("ns", KEYS).hits == 0 and b_to_a.disconnects == 1
    assert b.counters.failures["a", cause] == 1
    assert a.leases.open == (0, 0) and a.group.index.stats().pinned == 0


def test_a_lease_the_peer_could_not_have_granted_is_released_unread(nodes):
    a, b, b_to_a, _ = nodes

    def duplicated(answer):
        answer.blocks[1].position = answer.blocks[0].position
        return answer

    b_to_a.answer = duplicated
    assert b.group.promote("ns", KEYS, tiers=[_store(b, b_to_a)]) == {}
    assert b.agent.transfers == 0 and b.manager.lookup("ns", KEYS).hits == 0
    assert a.leases.open == (0, 0) and a.group.index.stats().pinned == 0


def test_a_lease_ended_before_the_read_is_a_miss_and_the_peer_unpins_at_its_deadline(nodes):
    a, b, b_to_a, _ = nodes
    store = _store(b, b_to_a, lease_ms=1)
    fetch = store.fetch("ns", KEYS)
    time.sleep(0.05)  # the 1 ms lease is over: reading now could read a reused slot
    slots = b.group.index.prepare_store("ns", [b"t"]).slots
    assert fetch.read([(0, b.group.host.buffer[slots[0]])]) == [(Outcome.NOT_FOUND, 0)]
    assert b.agent.transfers == 0
    for _ in range(200):  # the peer's timer ends it
        if a.leases.open == (0, 0):
            break
        time.sleep(0.05)
    assert a.leases.open == (0, 0) and a.leases.expired == 1 and a.group.index.stats().pinned == 0


def test_a_push_publishes_what_arrives_intact_and_refuses_what_does_not(nodes):
    a, b, _, a_to_b = nodes
    a.agent.register(a.group.host.buffer.data_ptr(), a.group.host.buffer.numel())
    pushed = push(a.agent, a_to_b, a.counters, a.group, "ns", KEYS[:2] + [b"absent"], 5000)
    assert pushed.outcomes == [Outcome.DONE, Outcome.DONE, Outcome.NOT_FOUND] and pushed.blocks == 2
    assert torch.equal(b.host_bytes(KEYS[1]), a.block(2))
    a.agent.corrupt_next = True
    pushed = push(a.agent, a_to_b, a.counters, a.group, "ns", KEYS[2:], 5000)
    assert pushed.outcomes == [Outcome.DATA_LOSS] * 2  # b checked them at commit: never published
    assert b.manager.lookup("ns", KEYS[2:]).hits == 0 and a.manager.lookup("ns", KEYS[2:]).hits == 2
    again = push(a.agent, a_to_b, a.counters, a.group, "ns", KEYS[:2], 5000)
    assert again.outcomes == [Outcome.DONE] * 2 and again.blocks == 0  # held there already: nothing written
    assert b.leases.open == (0, 0) and a.group.index.stats().pinned == 0


def test_one_peer_cannot_hold_more_leases_than_its_share(nodes):
    fabric: dict = {}
    a = Node(fabric, "a", 1, max_leases_per_peer=1)
    try:
        assert a.manager.offload("ns", [(1, KEYS[0])]).outcomes == [Outcome.DONE]
        first = a.leases.grant("b", "g", a.group.format.fingerprint, "ns", [KEYS[0]], 5000)
        with pytest.raises(ResourceExhausted, match="at most 1 a peer"):
            a.leases.grant("b", "g", a.group.format.fingerprint, "ns", [KEYS[0]], 5000)
        assert a.leases.grant("c", "g", a.group.format.fingerprint, "ns", [KEYS[0]], 5000) is not None
        assert a.leases.release("b", first.exposed_id, []) and not a.leases.release("b", first.exposed_id, [])
    finally:
        a.close()


def test_a_lease_bound_counts_the_blocks_held_not_the_keys_asked():
    """A peer may ask for many keys of which few are held: the bound is on blocks leased (configuration.md)."""
    fabric: dict = {}
    a = Node(fabric, "a", 1, max_leased_blocks_per_peer=4)
    try:
        assert a.manager.offload("ns", [(i + 1, k) for i, k in enumerate(KEYS)]).outcomes == [Outcome.DONE] * 4
        asked = KEYS[:3] + [b"absent-%d" % i for i in range(100)]
        granted = a.leases.grant("b", "g", a.group.format.fingerprint, "ns", asked, 5000)
        assert granted is not None and a.leases.open == (1, 3)  # 3 blocks held of 103 keys asked
        with pytest.raises(ResourceExhausted, match="holds 3 blocks; at most 4"):
            a.leases.grant("b", "g", a.group.format.fingerprint, "ns", KEYS[2:], 5000)  # 2 more held: 5 > 4
        assert a.group.index.stats().pinned == 3  # the refused lease pinned nothing
        assert a.leases.grant("b", "g", a.group.format.fingerprint, "ns", [KEYS[3]] + asked[3:], 5000) is not None
    finally:
        a.close()


def _peered(b: Node, link: FakeLink, lease_ms: int = 5000) -> PoolManager:
    """``b``'s pool in a new group whose one lower tier is its peers (as a daemon's shared group has)."""
    peers = SimpleNamespace(agent=b.agent, links=[link], counters=b.counters,
                            settings=PeeringSettings("b", lease_ms=lease_ms))
    return PoolManager(b.pool, CacheGroup("g", b.pool.layout, 8, lower=lambda ctx: [PeerTier(peers, ctx)]))


def _no_second_pass(monkeypatch) -> None:
    def verify(self, landed):
        raise AssertionError("a restore's pulled block was checksummed in a pass of its own")

    monkeypatch.setattr(PeerTier, "_verify", verify)


def test_a_restore_checks_a_pulled_block_in_its_copy_and_publishes_it_only_then(nodes, monkeypatch):
    """One pass fewer: the NIXL read lands in host slots; the copy into the engine's pool checks each block
    (the C loop hashes as it copies) and only then is it published; the lease is released after."""
    a, b, b_to_a, _ = nodes
    _no_second_pass(monkeypatch)
    manager = _peered(b, b_to_a)
    result = manager.run(TransferBatch.build(TransferKind.RESTORE, "ns", [9, 10], KEYS[:2], SPEC.num_blocks,
                                             peer=b_to_a.name))
    assert result.outcomes == [Outcome.DONE, Outcome.DONE]
    assert torch.equal(b.block(9), a.block(1)) and torch.equal(b.block(10), a.block(2))
    assert manager.lookup("ns", KEYS[:2]).hits == 2 and manager.group.index.stats().pinned == 0
    assert b_to_a.released and b_to_a.released[0][1] == [] and a.leases.open == (0, 0)
    assert b.counters.events()["read"] == 2
    assert manager.run(TransferBatch.build(TransferKind.RESTORE, "ns", [11], KEYS[:1], SPEC.num_blocks)).outcomes \
        == [Outcome.DONE]  # from host memory now: it was published with the peer's checksum


def test_a_pulled_block_wrong_in_the_copy_is_data_loss_never_published_and_reported(nodes, monkeypatch):
    a, b, b_to_a, _ = nodes
    _no_second_pass(monkeypatch)
    manager = _peered(b, b_to_a)
    b.agent.corrupt_next = True  # the wire flips a byte of each block
    result = manager.run(TransferBatch.build(TransferKind.RESTORE, "ns", [9, 10, 11], KEYS[:3], SPEC.num_blocks))
    assert result.outcomes == [Outcome.DATA_LOSS] * 3
    stats = manager.group.index.stats()
    assert stats.used == 0 and stats.pinned == 0  # nothing of them visible, no slot left reserved
    assert sorted(b_to_a.released[0][1]) == [0, 1, 2] and a.leases.open == (0, 0)
    assert b.counters.events() == {"read": 0, "served": 0, "failed_corrupt": 3}
    assert manager.run(TransferBatch.build(TransferKind.RESTORE, "ns", [9], KEYS[:1], SPEC.num_blocks)).outcomes \
        == [Outcome.DONE] and torch.equal(b.block(9), a.block(1))  # read again, intact this time


def test_a_restore_of_held_and_pulled_blocks_at_once_keeps_batch_order(nodes, monkeypatch):
    a, b, b_to_a, _ = nodes
    manager = _peered(b, b_to_a)
    assert manager.run(TransferBatch.build(TransferKind.RESTORE, "ns", [9], [KEYS[2]], SPEC.num_blocks)).outcomes \
        == [Outcome.DONE]  # KEYS[2] now in b's host tier
    _no_second_pass(monkeypatch)
    result = manager.run(TransferBatch.build(TransferKind.RESTORE, "ns", [12, 13, 14, 15],
                                             [KEYS[3], KEYS[2], b"absent", KEYS[0]], SPEC.num_blocks))
    assert result.outcomes == [Outcome.DONE, Outcome.DONE, Outcome.NOT_FOUND, Outcome.DONE]
    assert [torch.equal(b.block(n), a.block(i)) for n, i in ((12, 4), (13, 3), (15, 1))] == [True] * 3
    assert manager.group.index.stats().pinned == 0 and a.leases.open == (0, 0)


def test_a_pulled_block_wrong_after_its_lease_ended_under_the_read_is_a_miss_not_data_loss(nodes, monkeypatch):
    """The read ended after the lease: the peer may have reused the slot, so wrong bytes say nothing of the
    block. The copy's check drops it as a miss, and the peer is not told it is corrupt."""
    a, b, b_to_a, _ = nodes
    manager = _peered(b, b_to_a, lease_ms=100)
    read = b.agent.read

    def slow_read(*args):
        result = read(*args)
        time.sleep(0.3)  # ends after the lease
        return result

    monkeypatch.setattr(b.agent, "read", slow_read)
    b.agent.corrupt_next = True
    result = manager.run(TransferBatch.build(TransferKind.RESTORE, "ns", [9], KEYS[:1], SPEC.num_blocks))
    assert result.outcomes == [Outcome.NOT_FOUND]
    assert manager.group.index.stats().used == 0 and manager.group.index.stats().pinned == 0
    assert b.counters.events().get("failed_lease_expired") == 1 and "failed_corrupt" not in b.counters.events()
    assert all(corrupt == [] for _, corrupt in b_to_a.released)
