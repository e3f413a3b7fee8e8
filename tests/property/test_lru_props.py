"""The LRU policy against an ordered-dict model, through many queue copies (issue 32: no pause)."""

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.index.eviction import LRU

CAPACITY = 24
ops = st.lists(st.one_of(
    st.tuples(st.just("use"), st.lists(st.integers(0, CAPACITY - 1), min_size=1, max_size=40)),
    st.tuples(st.just("evict"), st.integers(1, 8)),
    st.tuples(st.just("pin"), st.integers(0, CAPACITY - 1)),
    st.tuples(st.just("unpin"), st.integers(0, CAPACITY - 1)),
), max_size=150)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([1, 2, 8]))
def test_victims_are_the_least_recently_used_evictable_slots(steps, step):
    lru = LRU(CAPACITY)
    lru.STEP, lru.MIN_STEP = step, 1  # copy a little at a time: queues are swapped often
    lru._queue_slot, lru._queue_stamp = np.empty(4, dtype=np.int64), np.empty(4, dtype=np.int64)
    swaps = [0]
    start_copy = lru._start_copy

    def counted(room: int) -> None:
        swaps[0] += lru._next is None
        start_copy(room)

    lru._start_copy = counted
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
        elif op == "pin":
            pinned.add(arg)
        elif arg in pinned:  # unpinned: used again, as the index does
            pinned.discard(arg)
            if arg in model:
                lru.used(np.array([arg], dtype=np.int64))
                model.move_to_end(arg)
        order = lru.ordered(np.array(list(model), dtype=np.int64)).tolist()
        assert order == list(model)
    assert swaps[0] > 0 or sum(len(a) for op, a in steps if op == "use") < 3


def test_a_batch_larger_than_the_queue_and_a_long_run_keep_the_queue_bounded():
    lru = LRU(1000)
    lru.used(np.arange(1000, dtype=np.int64))
    lru.used(np.arange(1000, dtype=np.int64)[::-1])  # more than the queue held: grows at once
    for i in range(2000):
        lru.used(np.array([i % 1000], dtype=np.int64))
        assert len(lru.victims(1, lambda s: np.ones(len(s), dtype=bool))) == 1
    assert len(lru._queue_slot) <= 8 * 1000  # stale uses are dropped as it goes, never piled up
