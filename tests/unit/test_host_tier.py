"""The host tier serves at once whatever its size (issue 32): pages are faulted in behind it, never written."""

import numpy as np

from kvxfer.tiers.host import HostTier


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
