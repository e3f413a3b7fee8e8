"""Blocks one daemon holds restored on another, read over NIXL, bit-exact."""

import pytest

from kvxfer.records import Outcome

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
