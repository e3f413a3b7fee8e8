"""The shared filesystem tier through real daemons: two "nodes" over one directory (issue 30)."""

import time

import pytest

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.records import Outcome, TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.test_remote import offload, restore

pytestmark = pytest.mark.e2e


def _node(shared) -> launch.DaemonProcess:
    return launch.spawn({"grace_period_s": 5, "log_level": "info", "pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}],
                         "shared_fs": {"path": str(shared), "timeout_ms": 2000}})


def test_a_node_restores_what_another_evicted_to_the_shared_directory_bit_exact(tmp_path):
    a, b = _node(tmp_path), _node(tmp_path)
    try:
        keys = [b"s%02d" % i for i in range(48)]  # the host tier holds 32 blocks of 16 KiB: the first 16 go down
        shadow = offload(a, keys)
        deadline = time.monotonic() + 20
        with Client(b.target) as client:
            while client.lookup(keys[:8], pool_ids=["rank0"]).tiers != [TierKind.SHARED_FS] * 8:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        outcomes, blocks = restore(b, keys[:8])
        assert outcomes == [Outcome.DONE] * 8
        for key, data in zip(keys[:8], blocks):
            assert data.equal(shadow[key])
        with Client(a.target) as client:
            assert client.delete(keys[8:10]) == 2  # a Delete on one node removes the shared files for all
        with Client(b.target) as client:
            assert client.lookup(keys[8:10], pool_ids=["rank0"]).tiers == [None, None]
            assert client.lookup(keys[10:11], pool_ids=["rank0"]).tiers == [TierKind.SHARED_FS]
            (shared,) = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.SHARED_FS]
            assert shared.events["promoted"] == 8 and not shared.degraded
    finally:
        a.cleanup()
        b.cleanup()


def test_a_missing_mount_is_refused_at_start_with_one_line(tmp_path):
    daemon = launch.spawn({"pools": [SMALL_POOL], "shared_fs": {"path": str(tmp_path / "not-mounted")}}, wait=False)
    try:
        assert daemon.proc.wait(30) != 0
        assert "shared_fs.path" in daemon.log_text() and "Traceback" not in daemon.log_text()
    finally:
        daemon.cleanup()
