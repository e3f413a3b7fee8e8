"""The host tier serves at once whatever its size (issue 32): pages are faulted in behind it, never written."""

import ctypes
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.errors import Internal
from kvxfer.geometry.block_checksum import rows_checksums
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.tiers import host
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import native


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_large_tier_is_made_without_faulting_it_in_and_its_pages_come_behind():
    before = _rss()
    tier = HostTier(2048, 1 << 20)  # 2 GiB
    assert _rss() - before < 1 << 30  # not faulted in up front (a chunk or two of the background's, at most)
    pattern = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    for slot in (0, 1000, 2047):  # offloads write while the background faults pages in
        tier.write(slot, memoryview(pattern))
    assert tier.populated.wait(120)
    assert _rss() - before > 1 << 30  # the memory is there now
    for slot in (0, 1000, 2047):
        assert bytes(tier.read(slot)) == pattern.tobytes()  # faulting in never wrote a byte
    assert not np.asarray(tier.read(5)).any()  # fresh pages read as zero


def test_faulting_pages_in_lets_other_threads_run(monkeypatch):
    """Issue 51: ``mmap.madvise`` held the GIL through each chunk, so a 4 GiB tier stalled every
    transfer in the daemon for 10-24 s after start. With the whole tier one chunk, this thread
    (counting resident pages through ``PyDLL``, which keeps the GIL) sees it partly faulted in: it
    could not while the faulting call held the GIL (it would see none, then all)."""
    keeps_gil = ctypes.PyDLL(None)
    keeps_gil.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    nbytes = 1 << 30
    monkeypatch.setattr(host, "POPULATE_CHUNK", nbytes)
    monkeypatch.setattr(host, "POPULATE_NICE", 0)  # a busy machine must not starve it for this test
    tier = HostTier(nbytes >> 20, 1 << 20)
    pages = (ctypes.c_ubyte * (nbytes // 4096))()
    seen = set()
    while not tier.populated.is_set():
        assert keeps_gil.mincore(tier.buffer.data_ptr(), nbytes, pages) == 0
        seen.add(int((np.frombuffer(pages, dtype=np.uint8) & 1).sum()))
    assert tier.populated.wait(120)
    assert any(0 < count < nbytes // 4096 for count in seen), sorted(seen)


@settings(max_examples=30, deadline=None)
@given(slots=st.lists(st.integers(0, 15), min_size=0, max_size=20), threads=st.integers(1, 3),
       slot_bytes=st.sampled_from([4096, 65536 + 4096, 3 * 65536]), seed=st.integers(0, 2**32 - 1))
def test_slot_checksums_are_the_block_checksum_on_any_thread_count(slots, threads, slot_bytes, seed):
    """What a peer's read or a lease is verified by: the C loop (off the GIL, ``hash_threads`` threads)
    computes kvxfer's block checksum of each slot, repeated slots too, as the Python definition does."""
    tier = HostTier(16, slot_bytes, hasher=native.load(), hash_threads=threads)
    tier.buffer.copy_(torch.randint(0, 256, tier.buffer.shape, dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(seed)))
    assert tier.checksums(slots) == rows_checksums(tier.buffer[s].numpy() for s in slots)


def test_a_groups_slot_checksums_hash_off_the_gil_where_the_c_loop_is_built(monkeypatch):
    """A batch of slots is hashed by the C loop (``hash_spans``), not under the GIL piece by piece, in a
    cache group's host tier as made by the daemon; a slot outside the tier is a bug, refused before
    anything is read."""
    hasher = native.load()
    if hasher is None:
        pytest.skip("the C loop is not built here (the Python loop is the fallback)")
    calls = []
    monkeypatch.setattr(type(hasher), "hash_spans", lambda self, *a: calls.append(a) or [0] * len(a[1]))
    layout = Pool.create("p", KVSpec(2, 16, 16, 2, 32, torch.float16), Layout.parse("BLHNC")).layout
    tier = CacheGroup("g", layout, 4, hash_threads=2).host
    assert tier.checksums([0, 3]) == [0, 0] and len(calls) == 1 and calls[0][3] == 2
    with pytest.raises(Internal):
        tier.checksums([0, 4])
    with pytest.raises(Internal):  # one slot (the Python loop's path): a negative index would read the last
        tier.checksums([-1])


def test_a_group_says_its_host_tier_is_warming_until_it_is_faulted_in(monkeypatch):
    """TierStats.warming follows the populating thread: set while it runs, clear once every page is in."""
    release = threading.Event()
    real = host._populate

    def held(*args):
        release.wait(60)
        real(*args)

    monkeypatch.setattr(host, "_populate", held)
    group = CacheGroup("g", Pool.create("p", KVSpec(2, 16, 16, 2, 32, torch.float16), Layout.parse("BLHNC")).layout, 8)
    try:
        assert group.tier_stats()[0].warming
        release.set()
        assert group.host.populated.wait(60)
        assert not group.tier_stats()[0].warming
    finally:
        release.set()
        group.close()
