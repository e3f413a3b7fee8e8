"""Refaults tell a thrashing tier from a full, healthy one (issue 50: KvxferTierThrashing fired on a
steady 512 MiB tier, whose evictions alone exceeded its capacity every 10 minutes)."""

from kvxfer.core.records import TierKind
from kvxfer.index.block_index import BlockIndex
from kvxfer.index.refaults import MAX_WINDOW, Refaults

NS = "ns"


def _store(index: BlockIndex, keys: list[bytes], namespace: str = NS) -> None:
    plan = index.prepare_store(namespace, keys)
    index.complete_store(plan.slots, [1] * len(plan.slots))


def test_a_stream_of_new_blocks_evicts_without_refaults():
    index = BlockIndex(TierKind.HOST, 64)
    for first in range(0, 10_000, 16):
        _store(index, [b"%d" % i for i in range(first, first + 16)])
    stats = index.stats()
    assert stats.evictions > 9_000 and stats.refaults == 0


def test_a_hot_set_that_fits_has_no_refaults_while_one_pass_blocks_turn_over():
    index = BlockIndex(TierKind.HOST, 64)
    hot = [b"hot%d" % i for i in range(32)]
    for first in range(0, 4_000, 8):
        loaded = index.prepare_load(NS, hot[:8])  # reused: a hit keeps them recent
        index.complete_load(loaded.slots)
        _store(index, [b"once%d" % i for i in range(first, first + 8)] + ([] if first else hot))
    assert index.stats().evictions > 3_000 and index.stats().refaults == 0


def test_a_loop_over_more_than_the_tier_refaults_every_block():
    index = BlockIndex(TierKind.HOST, 64)
    loop = [b"%d" % i for i in range(96)]  # LRU's worst case: each block is evicted just before its reuse
    for _ in range(10):
        for first in range(0, 96, 8):
            keys = loop[first:first + 8]
            missing = [k for k, there in zip(keys, index.contains(NS, keys)) if not there]
            _store(index, missing)
    stats = index.stats()
    assert stats.refaults >= 0.9 * stats.evictions and stats.evictions > 800


def test_the_same_key_in_another_namespace_is_not_a_refault():
    index = BlockIndex(TierKind.HOST, 4)
    _store(index, [b"a", b"b", b"c", b"d"])
    _store(index, [b"e", b"f"])  # evicts a, b
    _store(index, [b"a", b"b"], namespace="other")  # evicts c, d
    assert index.stats().refaults == 0
    _store(index, [b"a", b"b"])
    assert index.stats().refaults == 2


def test_the_window_is_bounded():
    refaults = Refaults(1 << 30)
    assert refaults.window == MAX_WINDOW
    for first in range(0, 3 * MAX_WINDOW, 4096):
        refaults.evicted(["n"], [b"%d" % i for i in range(first, first + 4096)])
    assert len(refaults._current) + len(refaults._previous) <= 2 * MAX_WINDOW
    refaults.stored("n", [b"0", b"%d" % (3 * MAX_WINDOW - 1)])  # the oldest was forgotten, the newest not
    refaults.stored("m", [b"%d" % (3 * MAX_WINDOW - 2)])  # another namespace's key
    assert refaults.count == 1
    refaults.stored("n", [b"%d" % (3 * MAX_WINDOW - 1)])  # counted once: it is in the tier again
    assert refaults.count == 1


def test_evictions_from_several_namespaces_at_once():
    refaults = Refaults(100)
    refaults.evicted(["a", "b", "a"], [b"x", b"x", b"y"])
    refaults.stored("b", [b"x", b"y"])
    refaults.stored("a", [b"x", b"y", b"z"])
    assert refaults.count == 3
