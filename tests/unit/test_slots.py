import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.errors import Internal
from kvxfer.core.slots import SlotAllocator


def test_a_fresh_tier_hands_out_runs_and_takes_back_what_was_released_first():
    a = SlotAllocator(10)
    assert a.allocate(4) == range(0, 4)
    assert a.allocate(3) == range(4, 7)
    a.release_many([5, 1, 2])
    assert a.free == 6
    assert a.allocate(3) == [1, 2, 5]  # released slots first, the lowest of a release first
    assert a.allocate(3) == range(7, 10)  # then the fresh tail
    assert a.allocate(1) is None and a.free == 0


def test_an_evicted_run_comes_back_as_a_range():
    """The full tier whose LRU order is its slot order: each batch gets the run its evictions freed."""
    a = SlotAllocator(1000)
    a.allocate(1000)
    a.release_many(range(200, 264))
    assert a.allocate(64) == range(200, 264)
    a.release_many(list(range(990, 1000)))
    assert a.allocate(4) == range(990, 994)  # part of a release: its lowest slots, in order


def test_bad_release():
    a = SlotAllocator(4)
    a.allocate(2)
    a.release_many([0])
    with pytest.raises(Internal):
        a.release_many([0])
    with pytest.raises(Internal):
        a.release_many([3])  # never allocated: free already
    with pytest.raises(Internal):
        a.release_many([4])
    with pytest.raises(Internal):
        a.release_many([1, 1])  # the same slot twice in one call
    assert a.free == 3  # a refused release changed nothing


def test_claim_rebuilds_from_the_slots_a_tier_holds():
    a = SlotAllocator(10)
    a.claim([7, 2, 3])
    assert a.free == 7
    got = sorted([*a.allocate(4), *a.allocate(3)])
    assert got == [0, 1, 4, 5, 6, 8, 9]
    with pytest.raises(Internal):
        SlotAllocator(4).claim([4])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.lists(st.tuples(st.booleans(), st.integers(0, 64)), max_size=60),
       st.integers(0, 2**32))
def test_never_the_same_slot_twice_and_every_slot_comes_back(capacity, steps, seed):
    rng = random.Random(seed)
    a, held = SlotAllocator(capacity), set()
    for take, n in steps:
        if take:
            got = a.allocate(n)
            if n > capacity - len(held):
                assert got is None
                continue
            got = list(got)
            assert len(got) == n == len(set(got)) and not set(got) & held
            assert all(0 <= s < capacity for s in got)
            held |= set(got)
        elif held:
            back = rng.sample(sorted(held), min(n, len(held)))
            a.release_many(back)
            held -= set(back)
        assert a.free == capacity - len(held) and a.used == len(held)
    a.release_many(sorted(held))
    assert sorted(a.allocate(capacity)) == list(range(capacity))
