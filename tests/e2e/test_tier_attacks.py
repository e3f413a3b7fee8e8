"""Attackers who can write inside a tier, and failures anyone can cause there, against real daemons
(issue 26, items 5-8): the disk tier's directory, and the Redis database."""

import os
import shutil
import signal
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.errors import ResourceExhausted
from kvxfer.core.records import Outcome, TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import REDIS, RedisServer
from tests.e2e.test_disk import Writer, check_served, wait_demoted
from tests.helpers import read_block

pytestmark = pytest.mark.e2e
POOLS = [{**SMALL_POOL, "host_capacity_mib": 0.5}, {**SMALL_POOL, "id": "rank1", "host_capacity_mib": 0.5}]


def _disk_daemon(path: Path) -> launch.DaemonProcess:
    return launch.spawn({"grace_period_s": 10, "log_level": "info", "pools": POOLS,
                         "disk": {"path": str(path), "capacity_mib": 10.24}})


def _written_down(disk: Path, prefix: bytes) -> dict:
    """48 blocks offloaded through a daemon with a disk tier, stopped with SIGTERM (its host tier
    goes down to disk too); returns their shadow copies."""
    daemon = _disk_daemon(disk)
    writer = Writer(daemon, prefix)
    try:
        writer.offload(48)
        wait_demoted(daemon, 16)
        return writer.shadow
    finally:
        writer.close()
        daemon.stop(signal.SIGTERM)
        daemon.cleanup()


def _key_of(path: Path) -> bytes:
    """The key in a block file's header (kvxfer.tiers.record: the fixed part, 68 bytes in version 1 and 72 in
    version 2 (the key's format), then the namespace and the key)."""
    header = path.read_bytes()[:4096]
    (version,) = struct.unpack_from("<I", header, 8)
    fixed = {1: 68, 2: 72}[version]
    ns_len, key_len = struct.unpack_from("<HH", header, 64)
    return header[fixed + ns_len:fixed + ns_len + key_len]


def _files(group_dir: Path) -> dict[bytes, Path]:
    return {_key_of(p): p for p in sorted(group_dir.glob("*/*.kvb"))}


def test_a_fifo_in_place_of_a_block_file_never_stops_the_daemon(tmp_path):
    daemon = _disk_daemon(tmp_path / "disk")
    try:
        writer = Writer(daemon, b"fifo-")
        writer.offload(48)  # a host tier of 32 blocks: 16 go down to disk
        wait_demoted(daemon, 16)
        for path in _files(tmp_path / "disk" / "rank0").values():
            path.unlink()
            os.mkfifo(path)  # an open() of it would wait for a writer for ever
        on_disk = list(writer.shadow)[:4]
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(writer.client.restore(
            [(on_disk[0], 3)], pool_id="rank0", partial=True, timeout=20).outcomes))
        thread.start()
        with Client(daemon.target) as client:
            for _ in range(10):  # (an open() waiting on the FIFO would hold its worker thread, not health)
                assert client.health(timeout=30) == "SERVING"
                time.sleep(0.02)
        thread.join(timeout=20)
        assert outcome == [[Outcome.DATA_LOSS]]  # not a block file: dropped, reported, never waited on
        writer.close()
    finally:
        daemon.cleanup()


def test_links_and_planted_files_in_the_disk_tier_are_never_followed_or_adopted(tmp_path):
    disk = tmp_path / "disk"
    shadow = _written_down(disk, b"plant-")
    group = disk / "rank0"
    files = _files(group)
    (linked, target), (foreign, copied) = list(files.items())[:2], list(files.items())[2:4]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"x" * 100)
    (group / "00ff").symlink_to(victim)  # a linked subdirectory: its target must never be scanned
    (group / ".lock").unlink()
    (group / ".lock").symlink_to(tmp_path / "outside")  # a dangling link: nothing may be created there
    linked[1].unlink()
    linked[1].symlink_to(target[1])  # a link to another block file
    os.chown(foreign[1], 65534, 65534)  # another user's file, writable by all
    os.chmod(foreign[1], 0o666)
    other_group = disk / "rank1" / copied[1].relative_to(group)
    other_group.parent.mkdir(exist_ok=True)
    shutil.copy2(copied[1], other_group)  # a block file copied into another cache group's directory
    restarted = _disk_daemon(disk)
    try:
        assert (victim / "precious").exists() and not (tmp_path / "outside").exists()
        assert not (group / "00ff").exists()  # the link itself is gone
        with Client(restarted.target) as client:
            tiers = client.lookup([linked[0], foreign[0], target[0], copied[0]], pool_ids=["rank0"]).tiers
            assert tiers == [None, None, TierKind.DISK, TierKind.DISK]  # neither adopted; the real ones are
            assert client.lookup([copied[0]], pool_ids=["rank1"]).tiers == [None]  # rank0's file is not rank1's
            pool = client.map_pool("rank0")
            assert client.restore([(target[0], 5)], pool_id="rank0").outcomes == [Outcome.DONE]
            assert torch.equal(read_block(pool.storage, pool.layout, 5), shadow[target[0]])
    finally:
        restarted.cleanup()


@pytest.fixture
def redis_server():
    if REDIS is None:
        pytest.skip("needs Debian's redis-server (.ci/run installs it)")
    server = RedisServer()
    yield server
    server.close()


def _redis_daemon(server: RedisServer, **remote) -> launch.DaemonProcess:
    return launch.spawn({"grace_period_s": 5, "log_level": "info", "pools": POOLS,
                         "remote": server.config(write_through=True, **remote)})


def _offload(daemon, pool_id: str, key: bytes) -> torch.Tensor:
    with Client(daemon.target) as client:
        pool = client.map_pool(pool_id)
        data = torch.randint(0, 256, (pool.layout.block_bytes,), dtype=torch.uint8)
        pool.storage[pool.layout.block_bytes:2 * pool.layout.block_bytes] = data  # BLHNC: block 1
        assert client.offload([(1, key)], pool_id=pool_id).outcomes == [Outcome.DONE]
        return data


def _restore(daemon, pool_id: str, key: bytes) -> Outcome:
    with Client(daemon.target) as client:
        return client.restore([(key, 7)], pool_id=pool_id, partial=True).outcomes[0]


def _stored(server: RedisServer, n: int) -> dict[bytes, bytes]:
    client = server.client()
    deadline = time.monotonic() + 20
    while len(names := client.keys("*")) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return {name: client.get(name) for name in names}


def test_another_groups_value_under_this_groups_key_is_never_served(redis_server):
    daemon = _redis_daemon(redis_server)
    try:
        _offload(daemon, "rank1", b"moved")
        ((name, value),) = _stored(redis_server, 1).items()
        redis_server.client().set(name.replace(b"rank1", b"rank0"), value)  # same namespace and key
        assert _restore(daemon, "rank0", b"moved") is Outcome.NOT_FOUND  # was DONE with rank1's bytes
        assert _restore(daemon, "rank1", b"moved") is Outcome.DONE
    finally:
        daemon.cleanup()


def test_with_a_secret_forged_or_moved_values_are_data_loss_and_deleted(redis_server, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    writer = _redis_daemon(redis_server, secret_file=str(secret))
    reader = _redis_daemon(redis_server, secret_file=str(secret))  # another node: it finds them in Redis
    try:
        _offload(writer, "rank0", b"real")
        _offload(writer, "rank0", b"other")
        _offload(writer, "rank0", b"kept")
        values = _stored(redis_server, 3)
        client = redis_server.client()
        (real,) = [n for n in values if n.endswith(b"real")]
        (other,) = [n for n in values if n.endswith(b"other")]
        assert _restore(reader, "rank0", b"kept") is Outcome.DONE  # what the writer stored is served
        client.set(other, values[real])  # a valid value moved under another key
        assert _restore(reader, "rank0", b"other") is Outcome.DATA_LOSS and not client.exists(other)
        body = values[real][:-32]  # header and block, which anyone can write: the MAC needs the secret
        client.set(real, body + os.urandom(32))
        assert _restore(reader, "rank0", b"real") is Outcome.DATA_LOSS and not client.exists(real)
        assert secret.read_bytes().hex() not in reader.log_text()
    finally:
        writer.cleanup()
        reader.cleanup()


class GatedProxy:
    """A TCP proxy in front of Redis that holds Redis's answers until ``gate`` is set (a Redis that does not
    answer yet); ``holding`` is set once an answer is held."""

    def __init__(self, upstream_port: int) -> None:
        import socket

        self.upstream = ("127.0.0.1", upstream_port)
        self.gate, self.holding = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(conn, up, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn, True), daemon=True).start()

    def _pipe(self, src, dst, held: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                if held and not self.gate.is_set():
                    self.holding.set()
                    self.gate.wait(60)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            src.close()
            dst.close()

    def close(self) -> None:
        self.closed = True
        self.gate.set()
        self.listener.close()


def test_a_slow_redis_never_slows_the_daemons_answers(redis_server):
    """A restore waiting on Redis runs on a worker thread: while Redis holds its answer, the daemon answers
    health at once (the old form of this test timed health calls against a 150 ms proxy: no wall clock here)."""
    writer = _redis_daemon(redis_server)
    proxy = GatedProxy(redis_server.port)
    config = redis_server.config(url=f"redis://127.0.0.1:{proxy.port}/0", timeout_ms=60_000)
    reader = launch.spawn({"grace_period_s": 5, "log_level": "info", "pools": POOLS, "remote": config})
    try:
        keys = [b"slow%02d" % i for i in range(4)]
        for key in keys:
            _offload(writer, "rank0", key)
        _stored(redis_server, len(keys))
        done: list[Outcome] = []
        thread = threading.Thread(target=lambda: done.extend(_restore(reader, "rank0", k) for k in keys))
        thread.start()
        assert proxy.holding.wait(60)  # a restore waits for Redis's answer now ...
        with Client(reader.target) as client:
            for _ in range(5):  # ... and the daemon answers meanwhile
                assert client.health(timeout=30) == "SERVING" and thread.is_alive()
        proxy.gate.set()
        thread.join(120)
        assert done == [Outcome.DONE] * len(keys)  # each one got what Redis held
    finally:
        proxy.close()
        writer.cleanup()
        reader.cleanup()


def test_excess_rpcs_are_refused_not_queued_while_one_holds_the_only_slot(redis_server):
    """``max_concurrent_rpcs: 1``: while a restore waits on Redis in the only slot, each further Offload over
    gRPC is refused with RESOURCE_EXHAUSTED at once (not queued behind it) and stores nothing; health still
    answers; once Redis answers, the restore is served and the next Offload is admitted. (The old form of this
    test fired 32 large offloads from 8 threads and hoped two overlapped: on a busy machine none did.)"""
    writer = _redis_daemon(redis_server)
    proxy = GatedProxy(redis_server.port)
    reader = launch.spawn({"grace_period_s": 5, "log_level": "info", "pools": POOLS, "max_concurrent_rpcs": 1,
                           "remote": redis_server.config(url=f"redis://127.0.0.1:{proxy.port}/0", timeout_ms=60_000)})
    try:
        _offload(writer, "rank0", b"held")
        _stored(redis_server, 1)
        done: list[Outcome] = []
        holder = Client(reader.target, lane=False, timeout=120)  # gRPC, both: the lane has its own bound
        thread = threading.Thread(target=lambda: done.extend(holder.restore([(b"held", 7)], pool_id="rank0").outcomes))
        thread.start()
        assert proxy.holding.wait(60)
        with holder, Client(reader.target, lane=False, timeout=30) as client:
            client.map_pool("rank0")
            refused, admitted, deadline = [], [], time.monotonic() + 60
            while not refused:  # (an Offload sent before the restore took the slot is admitted)
                assert time.monotonic() < deadline and thread.is_alive(), (admitted, done)
                key = b"excess%03d" % (len(admitted) + len(refused))
                try:
                    client.offload([(2, key)], pool_id="rank0")
                    admitted.append(key)
                except ResourceExhausted as exc:
                    assert "at most 1" in str(exc)
                    refused.append(key)
            assert client.health(timeout=30) == "SERVING" and thread.is_alive()
            proxy.gate.set()
            thread.join(120)
            assert done == [Outcome.DONE]
            assert client.offload([(2, b"after")], pool_id="rank0").outcomes == [Outcome.DONE]
            assert client.lookup(refused, pool_ids=["rank0"]).tiers == [None]  # the refused one stored nothing
    finally:
        proxy.close()
        writer.cleanup()
        reader.cleanup()


def test_entries_that_are_not_block_files_are_set_aside_and_the_daemon_starts(tmp_path):
    """Issue 30, item 1: a block file that became a directory (and a subdirectory that became a
    file, a directory at a write's temporary name, a file in the quarantine's place) stopped the
    start with IsADirectoryError. Each is set aside into quarantine/ (or removed), the daemon
    serves, the other blocks are intact, and the slots can be written again."""
    disk = tmp_path / "disk"
    shadow = _written_down(disk, b"dir-")
    group = disk / "rank0"
    files = _files(group)
    (gone_key, gone), (kept_key, kept) = list(files.items())[:2]
    gone.unlink()
    (gone / "inside").mkdir(parents=True)  # a block file became a directory, with something in it
    (gone.parent / (gone.name[:-4] + ".tmp")).mkdir()  # a directory at a write's temporary name too
    (group / "0003").write_bytes(b"not a directory")  # a file where slots 12288.. will want their subdirectory
    (group / "quarantine").write_bytes(b"in the way")
    restarted = _disk_daemon(disk)
    try:
        aside = sorted(p.name for p in (group / "quarantine").iterdir())
        assert len(aside) == 2 and all(gone.name[:-4] in name for name in aside), aside
        assert not gone.exists() and not (group / "0003").exists()
        with Client(restarted.target) as client:
            assert client.health(timeout=2) == "SERVING"
            assert client.lookup([gone_key, kept_key], pool_ids=["rank0"]).tiers == [None, TierKind.DISK]
            pool = client.map_pool("rank0")
            assert client.restore([(kept_key, 5)], pool_id="rank0").outcomes == [Outcome.DONE]
            assert torch.equal(read_block(pool.storage, pool.layout, 5), shadow[kept_key])
        again = Writer(restarted, b"again-")  # the host tier cycles onto disk
        try:
            again.offload(64)
            events = wait_demoted(restarted, 16)
            assert events.get("write_errors", 0) == 0, events
        finally:
            again.close()
        served, _ = check_served(restarted, again.shadow)  # every block served is the right one
        assert served > 0
    finally:
        restarted.cleanup()
