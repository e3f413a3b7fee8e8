"""The prefetcher over a real cache group: its queue is bounded in keys (RESOURCE_EXHAUSTED past it, nothing
queued), a CANCEL drops what its request queued, a closed group's prefetches are dropped, a stopped one
refuses more, and every key named ends in exactly one result (the counts always add up)."""

import threading
import time

import pytest
import torch

from kvxfer.core.errors import ResourceExhausted, Unavailable
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.prefetch import RESULTS, HintSettings, Prefetcher

LAYOUT = PoolLayout(KVSpec(2, 16, 4, 2, 8, torch.float16), PRESETS["BLHNC"])


def settled(p: Prefetcher, keys: int) -> dict[str, int]:
    deadline = time.monotonic() + 30  # a hang guard, not a timing
    while True:
        counts = p.counts()
        if counts.queued_keys == 0 and sum(counts.results.values()) >= keys:
            return counts.results
        assert time.monotonic() < deadline, counts
        time.sleep(0.01)


def stored(group: CacheGroup, keys: list[bytes]) -> None:
    plan = group.prepare_store("ns", keys)
    group.publish(plan.slots, [1] * len(plan.slots))


def test_every_key_ends_in_one_result_and_the_queue_is_bounded():
    group = CacheGroup("g", LAYOUT, 8)
    stored(group, [b"held"])
    p = Prefetcher(HintSettings(prefetch_queue_keys=8, prefetch_batch=2))
    try:
        with pytest.raises(ResourceExhausted, match="at most 8"):
            p.submit(group, "ns", [b"k%d" % i for i in range(9)], ("pool", "r"))
        assert p.counts().queued_keys == 0  # refused whole
        p.submit(group, "ns", [b"held", b"absent"], ("pool", "r"))
        results = settled(p, 2)
        assert results["present"] == 1 and results["absent"] == 1  # no lower tier: nothing to bring up
        assert set(results) == set(RESULTS)
    finally:
        p.stop()


def test_cancel_drops_what_a_request_queued_and_a_closed_groups_prefetches_go():
    group, other = CacheGroup("g", LAYOUT, 8), CacheGroup("h", LAYOUT, 8)
    p = Prefetcher(HintSettings(prefetch_batch=1))
    release = threading.Event()
    blocking = group.holds
    group.holds = lambda ns, keys: (release.wait(30), blocking(ns, keys))[1]  # the first batch waits here
    try:
        p.submit(group, "ns", [b"a0"], ("pool", "first"))
        p.submit(group, "ns", [b"b%d" % i for i in range(5)], ("pool", "cancel-me"))
        p.submit(group, "ns", [b"c0"], ("other-pool", "cancel-me"))  # another pool's request of the same id
        p.submit(other, "ns", [b"d%d" % i for i in range(3)], ("pool", "closed"))
        assert p.cancel(("pool", "cancel-me")) == 5
        other.close()
        release.set()
        results = settled(p, 1 + 5 + 1 + 3)
        assert results["cancelled"] == 5 + 3 and results["absent"] == 2
    finally:
        release.set()
        p.stop()


def test_a_stopped_prefetcher_refuses_new_prefetches():
    group = CacheGroup("g", LAYOUT, 8)
    p = Prefetcher(HintSettings())
    p.stop()
    with pytest.raises(Unavailable, match="stopping"):
        p.submit(group, "ns", [b"x"], ("pool", "r"))
    assert p.counts().queued_keys == 0
