"""Daemons with an object tier against a real S3 server (SeaweedFS, ``kvxfer.bench.s3_server``), for the object
tier's end-to-end tests (``test_object.py``: what it stores and serves; ``test_object_faults.py``: servers that
stall, refuse or die, and starts the bucket would refuse)."""


import pytest

from kvxfer.bench import launch
from kvxfer.bench.s3_server import S3Server
from kvxfer.core.records import TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.helpers import lookup_tiers, tier_events, until  # noqa: F401 (until: for the tests)

KEYS = [b"o%02d" % i for i in range(48)]  # the host tier holds 32 blocks of 16 KiB: the first 16 go down


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.close()


def node(s3: S3Server, tmp_path, prefix: str, wait: bool = True, **extra) -> launch.DaemonProcess:
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-at-least-16-bytes\n")
    section = {"url": f"s3://{s3.bucket}/{prefix}", "endpoint": s3.endpoint, "allow_http": True,
               "timeout_ms": 1000, "secret_file": str(secret), **extra}
    return launch.spawn({"grace_period_s": 5, "pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "object": section},
                        wait=wait, env=s3.env)


tiers = lookup_tiers


def events(daemon) -> dict:
    return tier_events(daemon, TierKind.OBJECT)
