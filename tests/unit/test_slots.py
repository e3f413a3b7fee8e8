import pytest

from kvxfer.errors import Internal
from kvxfer.tiers.slots import SlotAllocator


def test_contiguous_first_fit_and_merge():
    a = SlotAllocator(10)
    assert list(a.allocate(4)) == [0, 1, 2, 3]
    assert list(a.allocate(3)) == [4, 5, 6]
    for s in (1, 2, 5):
        a.release_many([s])
    assert a.free == 6
    assert list(a.allocate(3)) == [7, 8, 9]  # the only extent of 3
    assert list(a.allocate(2)) == [1, 2]
    a.release_many([4])
    a.release_many([6])  # 4, 5 (free already) and 6 merge into one extent
    assert list(a.allocate(3)) == [4, 5, 6]


def test_fragmented_takes_largest_extents_first():
    a = SlotAllocator(8)
    a.allocate(8)
    for s in (0, 2, 3, 5, 6, 7):
        a.release_many([s])
    assert sorted(a.allocate(5)) == [2, 3, 5, 6, 7]
    assert a.allocate(2) is None  # only one free: nothing taken
    assert list(a.allocate(1)) == [0]
    assert a.free == 0


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


def test_release_many_merges_runs_and_refuses_a_repeat():
    a = SlotAllocator(12)
    a.allocate(12)
    a.release_many([9, 3, 4, 11, 5, 0, 10])  # unsorted: extents [0], [3-5], [9-11]
    assert a.free == 7
    assert list(a.allocate(3)) == [3, 4, 5]  # first fit: one extent of 3
    with pytest.raises(Internal):
        a.release_many([1, 1])  # the same slot twice in one call
    assert list(a.allocate(3)) == [9, 10, 11]
