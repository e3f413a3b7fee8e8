"""Blocks one daemon holds restored on another, read over NIXL, bit-exact."""

import pytest

from kvxfer.core.records import Outcome, TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.peering.cluster import block, client, fill, keys

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("transport,layout", [("shm", "BLHNC"), ("tcp", "BLHNC"), ("shm", "LBHNC"),
                                              ("tcp", "flash_attn")])
def test_blocks_offloaded_on_a_are_restored_on_b_bit_exact(cluster, transport, layout):
    pool = {**SMALL_POOL, "layout": layout}
    d = cluster(["a", "b"], transport, pools={"a": pool, "b": pool})
    ks = keys(f"rt-{transport}", 6)
    with client(d["a"]) as a, client(d["b"]) as b:
        written = fill(a, list(range(1, 7)), seed=1)
        a.offload(list(zip(range(1, 7), ks)))
        assert b.lookup(ks).hits == 6
        result = b.restore(list(zip(ks, range(10, 16))))
        assert result.outcomes == [Outcome.DONE] * 6
        for i, slot in enumerate(range(10, 16)):
            assert block(b, slot).equal(written[i + 1])
        # Now B holds them itself: restored again without A.
        d["a"].stop()
        assert b.lookup(ks).hits == 6


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_pushes_blocks_into_b_before_b_is_asked(cluster, transport):
    d = cluster(["a", "b"], transport)
    ks = keys(f"push-{transport}", 5)
    with client(d["a"]) as a, client(d["b"]) as b:
        written = fill(a, [1, 2, 3, 4], seed=2)
        a.offload(list(zip([1, 2, 3, 4], ks[:4])))
        b_written = fill(b, [30], seed=3)
        b.offload([(30, ks[0])])  # B holds one already
        result = a.push(ks, "b", partial=True)
        assert result.outcomes == [Outcome.DONE] * 4 + [Outcome.NOT_FOUND]
        assert result.bytes == 3 * len(written[1])  # the three B lacked were written
        assert b.lookup(ks[:4]).tiers == [TierKind.HOST] * 4
        d["a"].stop()  # B serves them on its own now
        assert b.restore(list(zip(ks[:4], [40, 41, 42, 43]))).outcomes == [Outcome.DONE] * 4
        assert block(b, 40).equal(b_written[30])  # its own copy was kept
        assert all(block(b, 40 + i).equal(written[1 + i]) for i in (1, 2, 3))


def test_a_restore_larger_than_the_host_tier_says_it_had_no_room_for_a_peer_s_blocks(cluster):
    """B's host tier holds 16 blocks; one Restore of 32 that A holds: those that came up load, bit-exact, and the
    rest are RESOURCE_EXHAUSTED (B had no room), never NOT_FOUND: A holds them, as Lookup said."""
    d = cluster(["a", "b"], "tcp", pools={"b": {**SMALL_POOL, "host_capacity_mib": 0.25}})
    ks = keys("room", 32)
    with client(d["a"]) as a, client(d["b"]) as b:
        written = fill(a, list(range(1, 33)), seed=9)
        assert a.offload(list(zip(range(1, 33), ks))).outcomes == [Outcome.DONE] * 32
        assert b.lookup(ks).tiers == [TierKind.PEER] * 32
        outcomes = b.restore(list(zip(ks, range(32, 64))), partial=True).outcomes
        done = [i for i, o in enumerate(outcomes) if o is Outcome.DONE]
        assert set(outcomes) == {Outcome.DONE, Outcome.RESOURCE_EXHAUSTED} and len(done) == 16, outcomes
        assert all(block(b, 32 + i).equal(written[1 + i]) for i in done)
