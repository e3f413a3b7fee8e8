"""Daemons with a Mooncake Store tier against a real ``mooncake_master`` (``kvxfer.bench.mooncake_master``), for
the tier's end-to-end tests (``test_mooncake.py``: what it shares and refuses to serve; ``test_mooncake_faults.py``:
masters stopped, stalled or restarted, a node gone with its segment, a full store)."""

import importlib.util

import pytest

from kvxfer.bench import launch
from kvxfer.bench.mooncake_master import MooncakeMaster
from kvxfer.core.records import TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.helpers import lookup_tiers, tier_events, until  # noqa: F401 (until: for the tests)

KEYS = [b"m%02d" % i for i in range(48)]  # the host tier holds 32 blocks of 16 KiB: the first 16 go down
SECRET = "a-mooncake-secret-of-32-bytes!!\n"
needs_mooncake = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                    reason="kvxfer[mooncake] not installed (make install installs it)")


@pytest.fixture
def master():
    """A master of the test's own: a daemon killed by an earlier test leaves its segment registered until the
    master's client TTL passes, and puts placed there fail meanwhile."""
    server = MooncakeMaster()
    yield server
    server.close()


def node(cluster: MooncakeMaster, tmp_path, prefix: str = "kvxfer:", wait: bool = True, **extra):
    """A daemon whose host tier (32 blocks) demotes to the master's cluster; it lends 16 MiB to the pool."""
    secret = tmp_path / f"secret-{prefix.strip(':/')}"
    secret.write_text(SECRET)
    section = cluster.section(**{"key_prefix": prefix, "timeout_ms": 1000, "secret_file": str(secret),
                                "segment_mib": 16, **extra})
    return launch.spawn({"grace_period_s": 5, "pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}],
                         "mooncake": section}, wait=wait)


tiers = lookup_tiers


def events(daemon) -> dict:
    return tier_events(daemon, TierKind.MOONCAKE)
