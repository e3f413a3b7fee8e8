"""A lower tier added by a test alone (``tests/e2e/memo_tier.py``: one module, its config section, one
row of ``LOWER_TIERS``) serves a real daemon: evicted blocks go down into it, Lookup and Stats
name it, restores bring its blocks back bit-exact, Delete reaches it, and its config section is
validated like every other (issue 48)."""

import sys

import pytest

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.records import Outcome, TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.test_remote import offload, restore

pytestmark = pytest.mark.e2e
MEMO = [sys.executable, "-m", "tests.e2e.memo_tier"]


def test_a_tier_added_in_one_module_and_one_row_serves_a_daemon():
    daemon = launch.spawn({"grace_period_s": 5, "pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}],
                           "memo": {"capacity_blocks": 64}}, command=MEMO)
    try:
        keys = [b"m%02d" % i for i in range(48)]  # the host tier holds 32 blocks of 16 KiB: the first 16 go down
        shadow = offload(daemon, keys)
        with Client(daemon.target) as client:
            assert client.lookup(keys[:16], pool_ids=["rank0"]).tiers == [TierKind.REMOTE] * 16
            (memo,) = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.REMOTE]
            assert memo.used_blocks == 16 and memo.events["demoted"] == 16
        outcomes, blocks = restore(daemon, keys[:8])
        assert outcomes == [Outcome.DONE] * 8
        assert all(data.equal(shadow[key]) for key, data in zip(keys[:8], blocks))
        with Client(daemon.target) as client:
            assert client.delete(keys[8:10]) == 2
            assert client.lookup(keys[8:11], pool_ids=["rank0"]).tiers == [None, None, TierKind.REMOTE]
            (memo,) = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.REMOTE]
            assert memo.events["promoted"] == 8
    finally:
        daemon.cleanup()


def test_the_new_tier_s_config_section_is_validated_and_unknown_without_its_row():
    bad = launch.spawn({"pools": [SMALL_POOL], "memo": {"capacity_blocks": -1}}, wait=False, command=MEMO)
    plain = launch.spawn({"pools": [SMALL_POOL], "memo": {"capacity_blocks": 8}}, wait=False)  # no such row
    try:
        assert bad.proc.wait(60) != 0 and plain.proc.wait(60) != 0
        assert "memo: must be a mapping of capacity_blocks" in bad.log_text()
        assert "memo" in plain.log_text() and "unknown" in plain.log_text()
        assert "Traceback" not in bad.log_text() + plain.log_text()
    finally:
        bad.cleanup()
        plain.cleanup()
