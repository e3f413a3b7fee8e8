"""The index alone: LRU, pins, visibility, eviction. No tensors anywhere. Every test runs on the
C key table and use order (kvxfer/index/_tables.c, kvxfer/index/_use_order.c) and on their Python twins."""

import pytest

import kvxfer.core.slots as slots_module
import kvxfer.index.eviction as eviction
import kvxfer.index.keytable as keytable
from kvxfer.core.c_modules import FAST
from kvxfer.core.records import Outcome, TierKind
from kvxfer.index.block_index import BlockIndex

NS = "model-a"
DONE, PRESENT, MISSING, FULL = Outcome.DONE, Outcome.ALREADY_PRESENT, Outcome.NOT_FOUND, Outcome.RESOURCE_EXHAUSTED


@pytest.fixture(autouse=True, params=["c-passes", "python-passes"])
def passes(request, monkeypatch):
    if request.param == "python-passes":
        monkeypatch.setattr(keytable, "TABLES", None)
        monkeypatch.setattr(eviction, "USE_ORDER", None)
        monkeypatch.setattr(slots_module, "FAST", None)
    return FAST if request.param == "c-passes" else None


def store(index, keys, ok=True):
    plan = index.prepare_store(NS, keys)
    index.complete_store(plan.slots, [hash(keys[i]) & 0xFFFF if ok else None for i in plan.positions])
    return plan.outcomes


def test_visible_only_after_completion():
    index = BlockIndex(TierKind.HOST, 4)
    plan = index.prepare_store(NS, [b"a", b"b"])
    assert plan.outcomes == [DONE, DONE] and list(plan.positions) == [0, 1]
    assert index.contains(NS, [b"a", b"b"]) == [False, False]
    assert index.prepare_load(NS, [b"a"]).outcomes == [MISSING]
    assert index.stats().pinned == 2
    index.complete_store(plan.slots, [1, 2])
    assert index.contains(NS, [b"a", b"b"]) == [True, True]
    assert index.stats().pinned == 0 and index.stats().ready == 2


def test_failed_store_is_never_visible_and_frees_its_slot():
    index = BlockIndex(TierKind.HOST, 2)
    store(index, [b"a", b"b"], ok=False)
    assert index.contains(NS, [b"a", b"b"]) == [False, False]
    s = index.stats()
    assert (s.used, s.pinned, s.ready) == (0, 0, 0)
    assert store(index, [b"a", b"b"]) == [DONE, DONE]


def test_lru_evicts_oldest_unpinned():
    index = BlockIndex(TierKind.HOST, 3)
    store(index, [b"a", b"b", b"c"])
    loaded = index.prepare_load(NS, [b"a"])  # a is now pinned and most recent
    store(index, [b"d"])  # evicts b, the oldest unpinned
    assert index.contains(NS, [b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    index.complete_load(loaded.slots)
    store(index, [b"e"])  # c is now the oldest
    assert index.contains(NS, [b"a", b"c", b"d", b"e"]) == [True, False, True, True]
    assert index.stats().evictions == 2


def test_eviction_never_touches_pinned_and_reports_exhaustion():
    index = BlockIndex(TierKind.HOST, 2)
    store(index, [b"a", b"b"])
    loaded = index.prepare_load(NS, [b"a", b"b"])
    assert index.prepare_store(NS, [b"c"]).outcomes == [FULL]
    assert index.contains(NS, [b"a", b"b"]) == [True, True]
    index.complete_load(loaded.slots)
    assert index.stats().pinned == 0
    assert store(index, [b"c"]) == [DONE]


def test_a_full_tier_stores_what_it_can_evict_for_and_leaves_no_trace_of_the_rest():
    index = BlockIndex(TierKind.HOST, 4)
    store(index, [b"a", b"b", b"c"])
    loaded = index.prepare_load(NS, [b"a", b"b"])  # pinned: only c and one free slot are left
    plan = index.prepare_store(NS, [b"x", b"y", b"z"])
    assert plan.outcomes == [DONE, DONE, FULL] and [v.key for v in plan.evicted] == [b"c"]
    held = index._keys.find(NS, [b"a", b"b", b"c", b"x", b"y", b"z"]).tolist()
    assert held == [*loaded.slots, -1, *plan.slots, -1] and len(index._keys) == 4  # z is not in at all
    index.complete_store(plan.slots, [7, 8])
    index.complete_load(loaded.slots)
    assert index.contains(NS, [b"a", b"b", b"c", b"x", b"y", b"z"]) == [True, True, False, True, True, False]
    assert store(index, [b"z"]) == [DONE]


def test_present_keys_in_a_batch_are_not_evicted_for_its_new_keys():
    index = BlockIndex(TierKind.HOST, 2)
    store(index, [b"a", b"b"])
    assert store(index, [b"a", b"c"]) == [PRESENT, DONE]  # c must evict b, not a
    assert index.contains(NS, [b"a", b"b", b"c"]) == [True, False, True]


def test_corrupt_load_drops_entry():
    index = BlockIndex(TierKind.HOST, 2)
    store(index, [b"a"])
    loaded = index.prepare_load(NS, [b"a"])
    index.complete_load(loaded.slots, {0})
    assert index.contains(NS, [b"a"]) == [False]
    assert index.stats().used == 0 and index.locate(NS, b"a") is None


def test_delete_while_pinned_frees_at_unpin():
    index = BlockIndex(TierKind.HOST, 1)
    store(index, [b"a"])
    loaded = index.prepare_load(NS, [b"a"])
    assert index.delete(NS, [b"a", b"absent"]) == 1
    assert index.contains(NS, [b"a"]) == [False]
    assert index.stats().used == 1  # bytes still being read
    index.complete_load(loaded.slots)
    assert index.stats().used == 0
    assert index.contains(NS, [b"a"]) == [False]


def test_delete_of_a_store_in_flight_wins():
    index = BlockIndex(TierKind.HOST, 1)
    plan = index.prepare_store(NS, [b"a"])
    index.delete(NS, [b"a"])
    index.complete_store(plan.slots, [7])
    assert index.contains(NS, [b"a"]) == [False]
    assert index.stats().used == 0


def test_namespaces_are_separate():
    index = BlockIndex(TierKind.HOST, 4)
    store(index, [b"a"])
    assert index.contains("model-b", [b"a"]) == [False]
    assert index.prepare_load("model-b", [b"a"]).outcomes == [MISSING]
    assert store(index, [b"a"]) == [PRESENT]
    plan = index.prepare_store("model-b", [b"a"])
    assert plan.outcomes == [DONE]
    index.complete_store(plan.slots, [1])


def test_duplicate_store_while_in_flight_is_already_present():
    index = BlockIndex(TierKind.HOST, 4)
    plan = index.prepare_store(NS, [b"a"])
    assert index.prepare_store(NS, [b"a"]).outcomes == [PRESENT]
    index.complete_store(plan.slots, [1])
    assert index.stats().pinned == 0


def test_a_namespace_costs_nothing_once_its_blocks_are_gone():
    """Clients naming ever new namespaces (one per request, say) leave no structure behind."""
    import tracemalloc

    index = BlockIndex(TierKind.HOST, 4)

    def churn(first: int, n: int) -> None:
        for i in range(first, first + n):
            plan = index.prepare_store(f"ns{i}", [b"k"])  # evicts the oldest namespace's block
            index.complete_store(plan.slots, [i])
            if i % 3 == 0:
                index.delete(f"ns{i}", [b"k"])

    churn(0, 1000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    churn(1000, 20_000)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(index._keys._ids) == len(index._keys._names) == len(index._keys._counts) <= 4
    assert grown < 25_000  # bytes, for 20,000 namespaces (450 B each before; a constant 2 KB or so now)
    evicted = index.prepare_store("last", [b"a", b"b", b"c", b"d"]).evicted
    assert {v.namespace for v in evicted} <= {f"ns{i}" for i in range(20_990, 21_000)}  # names as they were


def test_a_store_that_evicts_its_own_namespace_empty_keeps_the_namespace():
    """Found by the store model: every entry of a namespace evicted to make room for that namespace's
    new keys released the namespace while the store was inserting into it (KeyError)."""
    index = BlockIndex(TierKind.HOST, 2)
    index.complete_store(index.prepare_store("m", [b"k1", b"k2"]).slots, [1, 2])
    plan = index.prepare_store("m", [b"k3", b"k4"])  # both old entries evicted: "m" empty for a moment
    assert plan.outcomes == [Outcome.DONE] * 2 and len(plan.evicted) == 2
    index.complete_store(plan.slots, [3, 4])
    assert index.contains("m", [b"k1", b"k2", b"k3", b"k4"]) == [False, False, True, True]


def test_stats_counters_follow_every_transition_without_a_pass_over_the_index():
    """Stats (every /metrics scrape) reads counters kept as entries change (issue 32), equal to a count."""
    from kvxfer.index.block_index import READY

    index = BlockIndex(TierKind.HOST, 8)

    def check(ready: int, pinned: int) -> None:
        stats = index.stats()
        assert (stats.ready, stats.pinned) == (ready, pinned)
        assert (int((index._state == READY).sum()), int(index._pins.astype(bool).sum())) == (ready, pinned)

    keys = [b"a", b"b", b"c", b"d"]
    plan = index.prepare_store("ns", keys)
    check(0, 4)
    index.complete_store(plan.slots, [1, 2, None, 4])  # one failed store: never visible
    check(3, 0)
    load = index.prepare_load("ns", [b"a", b"b"])
    check(3, 2)
    assert index.delete("ns", [b"a"]) == 1  # deleted while pinned: invisible now, freed at its unpin
    check(2, 2)
    index.complete_load(load.slots, corrupt={1})  # b was corrupt: dropped
    check(1, 0)
    index.prepare_store("ns", [b"x%d" % i for i in range(8)])  # evicts d to make room
    check(0, 8)
