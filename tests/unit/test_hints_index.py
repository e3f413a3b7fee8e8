"""Hints in the real index: released blocks leave first, retained ones last and only until their TTL, a read
makes a released block ordinary again, each tenant's hinted blocks stay within its share, wasted prefetch is
counted; and with no hints the victims are exactly LRU's (hypothesis over store, load, delete sequences)."""

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.records import EvictionReason, HintAction, Outcome, TierKind
from kvxfer.index.block_index import BlockIndex
from kvxfer.index.eviction import lru
from kvxfer.index.tenancy import Tenant

NS = "ns"


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def store(index, ids, namespace=NS):
    plan = index.prepare_store(namespace, [key(i) for i in ids])
    index.complete_store(plan.slots, [1] * len(plan.slots))
    return plan


def read(index, ids, namespace=NS):
    plan = index.prepare_load(namespace, [key(i) for i in ids])
    index.complete_load(plan.slots)
    return plan


def held(index, ids, namespace=NS):
    return [i for i, there in zip(ids, index.contains(namespace, [key(i) for i in ids])) if there]


def test_released_blocks_go_first_and_a_read_makes_them_ordinary():
    index = BlockIndex(TierKind.HOST, 8)
    store(index, range(8))
    assert index.hints.hint(NS, [key(6), key(7), key(99)], HintAction.RELEASE) == 2  # 99: absent, ignored
    store(index, [8, 9])
    assert held(index, range(10)) == [0, 1, 2, 3, 4, 5, 8, 9]  # the released went, not LRU's 0 and 1
    index.hints.hint(NS, [key(4), key(5)], HintAction.RELEASE)
    read(index, [5])  # another session still reads 5: ordinary again, and most recent
    store(index, [10, 11])
    assert held(index, range(12)) == [1, 2, 3, 5, 8, 9, 10, 11]  # 4 (released), then 0 (LRU)
    evicted = index.hints.stats().evicted
    assert evicted[EvictionReason.RELEASED.value] == 3 and evicted[EvictionReason.LRU.value] == 1


def test_retained_blocks_go_last_and_only_until_their_ttl():
    index = BlockIndex(TierKind.HOST, 4)
    store(index, range(4))
    now = time.monotonic()
    assert index.hints.hint(NS, [key(0), key(1)], HintAction.RETAIN, now + 3600) == 2
    store(index, [4, 5])
    assert held(index, range(6)) == [0, 1, 4, 5]  # 2 and 3 went; the retained oldest stayed
    store(index, [6, 7, 8])  # nothing else left: retained blocks are taken rather than a store failing
    assert len(held(index, range(9))) == 4 and index.hints.stats().evicted[EvictionReason.RETAINED.value] >= 1
    index2 = BlockIndex(TierKind.HOST, 2)
    store(index2, [0, 1])
    index2.hints.hint(NS, [key(0)], HintAction.RETAIN, time.monotonic() - 1)  # a TTL already passed: ordinary
    store(index2, [2])
    assert held(index2, [0, 1, 2]) == [1, 2]


def test_release_ends_a_retention_and_retain_takes_a_block_back_from_the_front():
    index = BlockIndex(TierKind.HOST, 3)
    store(index, [0, 1, 2])
    index.hints.hint(NS, [key(0)], HintAction.RETAIN, time.monotonic() + 60)
    index.hints.hint(NS, [key(0)], HintAction.RELEASE)
    store(index, [3])
    assert held(index, range(4)) == [1, 2, 3]
    index.hints.hint(NS, [key(1)], HintAction.RELEASE)
    index.hints.hint(NS, [key(1)], HintAction.RETAIN, time.monotonic() + 60)
    store(index, [4])
    assert held(index, range(5)) == [1, 3, 4]


def test_a_tenants_retained_and_prefetched_blocks_stay_within_its_share():
    tenants = (Tenant("a", 0.25, namespace_prefix="a/"), Tenant("b", 0.25, namespace_prefix="b/"))
    index = BlockIndex(TierKind.HOST, 16, tenants=tenants, hint_share=0.25)
    store(index, range(8), "a/x")
    store(index, range(8), "b/x")
    until = time.monotonic() + 3600
    assert index.hints.hint("a/x", [key(i) for i in range(8)], HintAction.RETAIN, until) == 4  # 0.25 x 16
    assert index.hints.hint("a/x", [key(0)], HintAction.RETAIN, until + 1) == 1  # a longer TTL for one it holds
    assert index.hints.hint("b/x", [key(i) for i in range(8)], HintAction.RETAIN, until) == 4  # b has its own
    assert index.hints.room("a/x", 10) == 0 and index.hints.stats().retained == 8
    index.hints.hint("a/x", [key(0), key(1)], HintAction.RELEASE)
    assert index.hints.room("a/x", 10) == 2  # released blocks give their room back
    short = time.monotonic() + 0.05
    index.hints.hint("a/x", [key(4), key(5)], HintAction.RETAIN, short)
    time.sleep(0.1)
    assert index.hints.room("a/x", 10) == 2  # passed TTLs too, once the share is asked for (2 and 3 still held)
    assert index.hints.mark_prefetched("a/x", [key(6), key(7)]) == 2 and index.hints.room("a/x", 10) == 0
    read(index, [6], "a/x")  # read: paid off, no longer counted
    assert index.hints.room("a/x", 10) == 1 and index.hints.stats().prefetched == 1


def test_a_prefetched_block_evicted_unread_is_wasted():
    index = BlockIndex(TierKind.HOST, 2)
    store(index, [0, 1])
    index.hints.mark_prefetched(NS, [key(0), key(1)])
    read(index, [1])
    store(index, [2, 3])
    stats = index.hints.stats()
    assert stats.wasted == 1 and stats.prefetched == 0


def test_deleting_hinted_blocks_clears_them():
    index = BlockIndex(TierKind.HOST, 4)
    store(index, range(4))
    index.hints.hint(NS, [key(0)], HintAction.RELEASE)
    index.hints.hint(NS, [key(1)], HintAction.RETAIN, time.monotonic() + 60)
    index.delete(NS, [key(0), key(1)])
    stats = index.hints.stats()
    assert (stats.released, stats.retained) == (0, 0)
    store(index, [0, 1, 4, 5])  # slots reused: nothing of the old hints sticks to them
    assert held(index, range(6)) == [0, 1, 4, 5]


OPS = st.lists(st.tuples(st.sampled_from(["store", "load", "delete"]),
                         st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 12))
def test_without_hints_the_victims_are_exactly_lrus(ops, capacity):
    hinted, plain = BlockIndex(TierKind.HOST, capacity), BlockIndex(TierKind.HOST, capacity, lru(capacity))
    for op, ids in ops:
        answers = []
        for index in (hinted, plain):
            if op == "store":
                plan = store(index, ids)
                answers.append((plan.outcomes, sorted(index.contains(NS, [key(i) for i in range(41)]))))
            elif op == "load":
                answers.append(read(index, ids).outcomes)
            else:
                answers.append(index.delete(NS, [key(i) for i in ids]))
        assert answers[0] == answers[1]
        assert held(hinted, range(41)) == held(plain, range(41))
    assert [e.key for e in hinted.entries()] == [e.key for e in plain.entries()]


@settings(max_examples=100, deadline=None)
@given(OPS, st.lists(st.tuples(st.sampled_from(list(HintAction)[1:3]), st.integers(0, 40)), max_size=30),
       st.integers(2, 12))
def test_hints_never_lose_count_or_fail_a_store_that_lru_would_not(ops, hints, capacity):
    hinted, plain = BlockIndex(TierKind.HOST, capacity, hint_share=1.0), BlockIndex(TierKind.HOST, capacity,
                                                                                   lru(capacity))
    until = time.monotonic() + 3600
    for step, (op, ids) in enumerate(ops):
        if step < len(hints):
            action, i = hints[step]
            hinted.hints.hint(NS, [key(i)], action, until)
        exhausted = []
        for index in (hinted, plain):
            if op == "store":
                exhausted.append(store(index, ids).outcomes.count(Outcome.RESOURCE_EXHAUSTED))
            elif op == "load":
                read(index, ids)
            else:
                index.delete(NS, [key(i) for i in ids])
        assert exhausted[:1] == exhausted[1:]  # hints never make a store fail where LRU's finds room
        stats, s = hinted.hints.stats(), hinted.stats()
        assert stats.retained + stats.released <= s.ready <= capacity
        assert s.used == len(held(hinted, range(41)))
    assert np.sum(list(hinted.hints.stats().evicted.values())) == hinted.stats().evictions


def test_a_retention_flood_never_keeps_another_tenant_from_its_guaranteed_share():
    tenants = (Tenant("a", 0.25, namespace_prefix="a/"), Tenant("b", 0.25, namespace_prefix="b/"))
    for share in (1.0, 0.5):
        index = BlockIndex(TierKind.HOST, 16, tenants=tenants, hint_share=share)
        store(index, range(16), "a/x")  # a fills the tier (12 of it borrowed) and retains all it may
        assert index.hints.hint("a/x", [key(i) for i in range(16)], HintAction.RETAIN, time.monotonic() + 3600) \
            == int(16 * share)
        assert store(index, range(4), "b/x").outcomes == [Outcome.DONE] * 4  # b takes back its 4
        assert len(held(index, range(4), "b/x")) == 4 and len(held(index, range(16), "a/x")) == 12
        stats = {t.name: t.blocks for t in index.stats().tenants}
        assert stats == {"other": 0, "a": 12, "b": 4}
