"""What one request or one client may make the daemon hold (issue 26, items 9-11), against real daemons."""

import os
from pathlib import Path

import pytest

from kvxfer.client import Client

pytestmark = pytest.mark.e2e


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.parametrize("key_bytes,most", [(16, 8.0), (256, 3.6)])  # before: 14.7x and 4.2x
def test_a_delete_of_the_most_keys_costs_little_beyond_its_request(make_daemon, key_bytes, most):
    """The keys are handled a chunk at a time; what stays is gRPC's and protobuf's decoded request
    (about 3 bytes for each byte of 16-byte keys, with their per-string overhead)."""
    daemon = make_daemon()
    keys = [os.urandom(key_bytes) for _ in range(65_536)]  # the most keys a request may name
    request_kib = sum(map(len, keys)) // 1024
    with Client(daemon.target, "del", timeout=60) as client:
        client.offload([(1, keys[0])], pool_id="rank0")
        client.delete(keys[:10], pool_id="rank0")  # warm the path
        Path(f"/proc/{daemon.proc.pid}/clear_refs").write_text("5")  # reset the peak to now
        before = _kib(daemon.proc.pid, "VmRSS")
        assert client.delete(keys, pool_id="rank0") == 0  # the first was deleted already
        peak = _kib(daemon.proc.pid, "VmHWM") - before
    print(f"delete of 65,536 keys of {key_bytes} B: peak {peak} KiB, request {request_kib} KiB")
    assert peak < most * request_kib, (peak, request_kib)
