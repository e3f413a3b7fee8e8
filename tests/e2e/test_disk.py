"""The disk tier through real daemons: the warm cache survives SIGKILL and SIGTERM, a crash at any
moment never serves a half-written block, and a full device is evicted into, never crashed on."""

import os
import random
import signal
import subprocess
import threading
import time

import pytest
import torch

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.records import Outcome, TierKind
from kvxfer.events.event_records import EventKind
from tests.e2e.conftest import SMALL_POOL
from tests.helpers import read_block, write_block

BLOCKS = range(1, SMALL_POOL["spec"]["num_blocks"])


def daemon_config(disk_path, **disk) -> dict:
    # A host tier of 32 blocks of 16 KiB, so that most offloads push older blocks down to disk.
    return {"grace_period_s": 10, "log_level": "info", "pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}],
            "disk": {"path": str(disk_path), "capacity_mib": 10.24, **disk}}


def pattern(key: bytes, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(key[-6:], "big") % (1 << 62))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


class Writer:
    """Offloads blocks of known content (a shadow copy per key) from a client."""

    def __init__(self, daemon, prefix: bytes) -> None:
        self.client = Client(daemon.target, timeout=5)
        self.pool = self.client.map_pool("rank0")
        self.layout, self.storage = self.pool.layout, self.pool.storage
        self.prefix, self.shadow, self.count = prefix, {}, 0

    def offload(self, n: int) -> None:
        for _ in range(n):
            key = self.prefix + b"%08d" % self.count
            block = BLOCKS[self.count % len(BLOCKS)]
            data = pattern(key, self.layout.block_bytes)
            write_block(self.storage, self.layout, block, data)
            self.shadow[key] = data  # before the call: a SIGKILL mid-call may or may not have stored it
            self.client.offload([(block, key)], pool_id="rank0")
            self.count += 1

    def close(self) -> None:
        self.client.close()


def check_served(daemon, shadow: dict) -> tuple[int, dict]:
    """Restore every key the daemon says it holds and compare with the shadow copy: (served, tiers)."""
    served, tiers = 0, {}
    with Client(daemon.target, timeout=30) as client:
        pool = client.map_pool("rank0")
        keys = list(shadow)
        for start in range(0, len(keys), 16):
            batch = keys[start:start + 16]
            found = client.lookup(batch, pool_ids=["rank0"])
            present = [k for k, t in zip(batch, found.tiers) if t is not None]
            for k, t in zip(batch, found.tiers):
                tiers[t] = tiers.get(t, 0) + 1
            if not present:
                continue
            result = client.restore([(k, BLOCKS[i]) for i, k in enumerate(present)], pool_id="rank0", partial=True)
            for i, (key, outcome) in enumerate(zip(present, result.outcomes)):
                assert outcome in (Outcome.DONE, Outcome.NOT_FOUND), (key, outcome)  # never DATA_LOSS
                if outcome is Outcome.DONE:
                    assert torch.equal(read_block(pool.storage, pool.layout, BLOCKS[i]), shadow[key]), key
                    served += 1
    return served, tiers


def wait_demoted(daemon, n: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    with Client(daemon.target) as client:
        while True:
            disk = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.DISK][0]
            if disk.events.get("demoted", 0) >= n and disk.pinned_blocks == 0:
                return disk.events
            assert time.monotonic() < deadline, disk
            time.sleep(0.05)


def test_the_warm_cache_survives_sigkill(tmp_path):
    config = daemon_config(tmp_path / "disk")
    daemon = launch.spawn(config)
    writer = Writer(daemon, b"warm-")
    writer.offload(200)
    wait_demoted(daemon, 200 - 32)
    deleted = list(writer.shadow)[:10]  # on disk by now: their removal is journaled before the files go
    assert writer.client.delete(deleted) == 10
    writer.close()
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    daemon.cleanup()
    restarted = launch.spawn(config)
    try:
        # Issue 32: the index from the base and the journal the crash left, not a scan of every file.
        assert '"source": "journal"' in restarted.log_text()
        with Client(restarted.target) as client:
            assert client.lookup(deleted, pool_ids=["rank0"]).tiers == [None] * 10  # deleted stays deleted
            first = next(iter(client.watch_events(["default"], from_sequence=1, timeout=10)))
            announced = {k for e in first.events if e.kind is EventKind.STORED and e.tier is TierKind.DISK
                         for k in e.keys}
            assert len(announced) >= 190 - 32 and not announced & set(deleted)  # what the load found: restorable
        for key in deleted:
            del writer.shadow[key]
        served, tiers = check_served(restarted, writer.shadow)
        assert served >= 190 - 32 and tiers.get(TierKind.DISK, 0) >= 190 - 32  # everything written down
        with Client(restarted.target) as client:
            disk = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.DISK][0]
        assert disk.events["found_at_start"] >= 190 - 32
    finally:
        restarted.cleanup()


def test_sigterm_writes_the_host_tier_down_for_the_next_start(tmp_path):
    config = daemon_config(tmp_path / "disk")
    daemon = launch.spawn(config)
    writer = Writer(daemon, b"term-")
    writer.offload(20)  # all of it in the host tier
    writer.close()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=60) == 0
    assert '"host tier written to disk"' in daemon.log_text() and '"blocks": 20' in daemon.log_text()
    daemon.cleanup()
    restarted = launch.spawn(config)
    try:
        served, tiers = check_served(restarted, writer.shadow)
        assert served == 20 and tiers == {TierKind.DISK: 20}
    finally:
        restarted.cleanup()


def test_a_crash_at_any_moment_never_serves_a_half_written_block(tmp_path):
    config = daemon_config(tmp_path / "disk")
    rng = random.Random(13)
    shadow: dict = {}
    served_total = 0
    for crash in range(50):
        daemon = launch.spawn(config)
        try:
            if shadow:  # what the last life stored and wrote down: bit-exact, or not there at all
                served, _ = check_served(daemon, shadow)
                served_total += served
            writer = Writer(daemon, b"crash%02d-" % crash)
            stop = threading.Event()

            def load():
                while not stop.is_set():
                    try:
                        writer.offload(8)
                    except Exception:  # the daemon was killed under the call
                        return

            thread = threading.Thread(target=load)
            thread.start()
            time.sleep(rng.uniform(0.05, 0.6))
            daemon.proc.send_signal(signal.SIGKILL)  # at a random moment of heavy demotion
            daemon.proc.wait()
            stop.set()
            thread.join()
            writer.close()
            shadow.update(writer.shadow)
        finally:
            daemon.cleanup()
    final = launch.spawn(config)
    try:
        served, tiers = check_served(final, shadow)
    finally:
        final.cleanup()
    assert served + served_total > 500  # the test exercised restores of demoted blocks, many of them


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs to fill (run as root, as CI does)")
def test_a_full_device_is_evicted_into_and_the_daemon_goes_on(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        daemon = launch.spawn(daemon_config(mount, capacity_mib=10.24))  # a quota ten times the device
        try:
            writer = Writer(daemon, b"full-")
            writer.offload(300)
            events = wait_demoted(daemon, 1)
            time.sleep(0.5)
            with Client(daemon.target) as client:
                disk = [t for t in client.stats("rank0")[0].tiers if t.tier is TierKind.DISK][0]
                assert client.health() == "SERVING"
            assert disk.events.get("evicted_for_space", 0) > 0 and not disk.degraded  # full is not broken
            served, _ = check_served(daemon, writer.shadow)
            assert served >= 32  # the host tier's blocks, and what fits on the device
            writer.close()
            assert events
        finally:
            daemon.cleanup()
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)  # even if a killed daemon still holds it
