"""The LRU policies against an ordered-dict model: the linked list in C (kvxfer/index/_use_order.c) and
its Python twin, a queue of uses copied a step at a time (issue 32: no pause in either)."""

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.index.eviction import USE_ORDER, LinkedLRU, QueueLRU

CAPACITY = 24
ops = st.lists(st.one_of(
    st.tuples(st.just("use"), st.lists(st.integers(0, CAPACITY - 1), min_size=1, max_size=40)),
    st.tuples(st.just("evict"), st.integers(1, 8)),
    st.tuples(st.just("pin"), st.integers(0, CAPACITY - 1)),
    st.tuples(st.just("unpin"), st.integers(0, CAPACITY - 1)),
    st.tuples(st.just("forget"), st.lists(st.integers(0, CAPACITY - 1), max_size=6, unique=True)),
), max_size=150)


def queue_lru(step: int) -> QueueLRU:
    lru = QueueLRU(CAPACITY)
    lru.STEP, lru.MIN_STEP = step, 1  # copy a little at a time: queues are swapped often
    lru._queue_slot, lru._queue_stamp = np.empty(4, dtype=np.int64), np.empty(4, dtype=np.int64)
    return lru


POLICIES = {"linked": lambda step: LinkedLRU(CAPACITY), "queue": queue_lru}


@pytest.mark.parametrize("kind", POLICIES)
@settings(max_examples=300, deadline=None)
@given(steps=ops, step=st.sampled_from([1, 2, 8]))
def test_victims_are_the_least_recently_used_evictable_slots(kind, steps, step):
    lru = POLICIES[kind](step)
    model: OrderedDict[int, None] = OrderedDict()  # used slots not evicted since, least recent first
    pinned: set[int] = set()
    for op, arg in steps:
        if op == "use":
            lru.used(np.array(arg, dtype=np.int64))
            for slot in arg:
                model.pop(slot, None)
                model[slot] = None
        elif op == "evict":
            got = lru.victims(arg, lambda slots: ~np.isin(slots, list(pinned))).tolist()
            expected = [s for s in model if s not in pinned][:arg]
            assert got == expected
            for slot in got:
                del model[slot]
        elif op == "forget":  # deleted entries: never victims until used again
            lru.forget(np.array(arg, dtype=np.int64))
            for slot in arg:
                model.pop(slot, None)
        elif op == "pin":
            pinned.add(arg)
        elif arg in pinned:  # unpinned: used again, as the index does
            pinned.discard(arg)
            if arg in model:
                lru.used(np.array([arg], dtype=np.int64))
                model.move_to_end(arg)
        order = lru.ordered(np.array(list(model), dtype=np.int64)).tolist()
        assert order == list(model)


def test_a_batch_larger_than_the_queue_and_a_long_run_keep_the_queue_bounded():
    lru = QueueLRU(1000)
    lru.used(np.arange(1000, dtype=np.int64))
    lru.used(np.arange(1000, dtype=np.int64)[::-1])  # more than the queue held: grows at once
    for i in range(2000):
        lru.used(np.array([i % 1000], dtype=np.int64))
        assert len(lru.victims(1, lambda s: np.ones(len(s), dtype=bool))) == 1
    assert len(lru._queue_slot) <= 8 * 1000  # stale uses are dropped as it goes, never piled up


def test_the_c_order_refuses_bad_slots_and_changes_nothing():
    order = USE_ORDER.UseOrder(8)
    order.used(np.array([3, 1, 5], dtype=np.int64))
    for bad in ([0, 8], [-1], [1, 2**40]):
        with pytest.raises(ValueError, match="out of range"):
            order.used(np.array(bad, dtype=np.int64))
        with pytest.raises(ValueError, match="out of range"):
            order.discard(np.array(bad, dtype=np.int64))
    with pytest.raises(ValueError, match="8-byte"):
        order.used(np.array([1], dtype=np.int32))
    for after in (0, 8, -2):  # not in the order, out of range
        with pytest.raises(ValueError, match="peek"):
            order.peek(after, np.empty(4, dtype=np.int64))
    out = np.empty(8, dtype=np.int64)
    assert out[:order.peek(-1, out)].tolist() == [3, 1, 5] and len(order) == 3
    assert out[:order.peek(1, out)].tolist() == [5]
    with pytest.raises(ValueError):
        USE_ORDER.UseOrder(-1)
