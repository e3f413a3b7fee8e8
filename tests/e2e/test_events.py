"""KV events through a real daemon: every change of every tier in order with no gap while blocks are
stored, evicted, demoted to disk, promoted, deleted and corrupted; a snapshot plus the events after
it equals what the tiers hold; a subscriber that fell 10,000 events behind resumes or is told to
resync; bad requests are refused; ``kvxfer events`` prints them; the metrics count them."""

import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.errors import InvalidArgument, ResourceExhausted
from kvxfer.core.records import Outcome, TierKind
from kvxfer.events.event_records import EventKind, Reason
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.test_metrics import free_port

BLOCKS = range(1, SMALL_POOL["spec"]["num_blocks"])


def config(tmp_path, metrics_port=None, **events):
    return {"log_level": "info", **({"metrics_listen": f"127.0.0.1:{metrics_port}"} if metrics_port else {}),
            "pools": [{**SMALL_POOL, "host_capacity_mib": 0.25}],  # 16 blocks: offloads evict to disk
            "disk": {"path": str(tmp_path / "disk"), "capacity_mib": 10.24}, "events": events}


class Watcher:
    """Collects a WatchEvents stream on a thread."""

    def __init__(self, daemon, namespaces=("m",), from_sequence=1):
        self.client = Client(daemon.target, timeout=10)
        self.batches, self.error = [], None
        self.stream = self.client.watch_events(list(namespaces), from_sequence=from_sequence, timeout=120)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for batch in self.stream:
                self.batches.append(batch)
        except Exception as exc:  # the stream ends with the test (cancelled or closed)
            self.error = exc

    @property
    def events(self):
        return [e for b in self.batches for e in b.events]

    def wait_for(self, sequence, timeout=20):
        """Until the stream has passed ``sequence`` (events of other namespaces are passed over; an idle
        stream says where it stands every few seconds)."""
        deadline = time.monotonic() + timeout
        while not self.batches or self.batches[-1].next_sequence <= sequence:
            assert time.monotonic() < deadline, (sequence, self.events[-3:], self.error)
            time.sleep(0.02)

    def close(self):
        self.client.close()  # ends the stream


def apply(state: dict, events) -> None:
    """(tier, key) -> present, from events applied in order."""
    for e in events:
        for key in e.keys:
            if e.kind is EventKind.STORED:
                state[(e.tier, key)] = True
            else:
                state.pop((e.tier, key), None)


def test_every_change_in_order_with_no_gap_and_a_snapshot_plus_events_is_the_truth(tmp_path):
    daemon = launch.spawn(config(tmp_path))
    watcher = Watcher(daemon)
    try:
        with Client(daemon.target, namespace="m", timeout=10) as client:
            pool = client.map_pool()
            pool.storage.fill_(3)
            for i in range(6):  # 48 blocks through a host tier of 16: evictions, demotions to disk
                client.offload([(b, b"k%03d" % (i * 8 + j)) for j, b in enumerate(BLOCKS[:8])])
            wait_disk(client, 32)
            assert client.restore([(b"k000", 1)]).outcomes  # promoted from disk into the host tier
            client.delete([b"k001", b"k047"])
            with Client(daemon.target, namespace="other") as other:  # another namespace: not watched
                other.offload([(1, b"x")])
            settle(client)  # demotions run on the disk's thread: their events come when they land
            last = last_sequence(daemon)
            watcher.wait_for(last)
            events = watcher.events
            assert [e.sequence for e in events] == sorted(e.sequence for e in events)
            assert all(e.namespace == "m" for e in events) and not any(b.resync for b in watcher.batches)
            assert watcher.batches[-1].next_sequence == last + 1
            kinds = {(e.kind, e.tier, e.reason) for e in events}
            assert {(EventKind.STORED, TierKind.HOST, None), (EventKind.REMOVED, TierKind.HOST, Reason.EVICTED),
                    (EventKind.STORED, TierKind.DISK, None), (EventKind.REMOVED, TierKind.HOST, Reason.DELETED),
                    (EventKind.REMOVED, TierKind.DISK, Reason.DELETED)} <= kinds
            # A slot's removal comes before the block that takes it is stored: the host tier never
            # holds more than its 16 blocks in the events' own accounting.
            state: dict = {}
            for e in events:
                apply(state, [e])
                assert sum(t is TierKind.HOST for t, _ in state) <= 16, e
            truth = {(t, k) for t, k in state}
            snap = list(client.snapshot(["m"]))
            assert snap[-1].tier is None and all(s.sequence == snap[0].sequence for s in snap)
            assert {(s.tier, k) for s in snap for k in s.keys} == truth  # no event since: the snapshot is the state
            keys = sorted({k for _, k in truth})
            assert None not in client.lookup(keys).tiers  # every key the events say is there, a lookup finds
            assert client.lookup([b"k001", b"k047"]).tiers == [None, None]
    finally:
        watcher.close()
        daemon.cleanup()


def wait_disk(client, n, timeout=20):
    deadline = time.monotonic() + timeout
    while True:
        disk = [t for t in client.stats()[0].tiers if t.tier is TierKind.DISK][0]
        if disk.ready_blocks >= n and disk.pinned_blocks == 0:
            return
        assert time.monotonic() < deadline, disk
        time.sleep(0.05)


def settle(client, timeout=20):
    """Until the tiers stop changing: nothing pinned, the disk's counters the same 0.3 s apart."""
    deadline, before = time.monotonic() + timeout, None
    while True:
        tiers = client.stats()[0].tiers
        now = [(t.tier, t.ready_blocks, t.pinned_blocks, sorted(t.events.items())) for t in tiers]
        if now == before and not any(t.pinned_blocks for t in tiers):
            return
        assert time.monotonic() < deadline, now
        before = now
        time.sleep(0.3)


def last_sequence(daemon) -> int:
    with Client(daemon.target) as client:
        for batch in client.watch_events(["m"], from_sequence=0, timeout=6):
            return batch.next_sequence - 1  # the first answer says where the stream stands
    return 0


def test_a_subscriber_10000_events_behind_resumes_or_is_told_to_resync(tmp_path):
    daemon = launch.spawn(config(tmp_path, replay_keys=50_000))
    try:
        with Client(daemon.target, namespace="m", timeout=10) as client:
            client.map_pool()
            for i in range(5000):  # 10,000 events: a store and an eviction each, once the tier is full
                client.offload([(1, b"b%06d" % i)])
            first = next(iter(client.watch_events(["m"], from_sequence=1, timeout=10)))
            assert not first.resync and first.events[0].sequence == 1  # all still held: resumes exactly
            stream = first.stream_id
            for i in range(5000, 30000):  # far more than the buffer holds
                client.offload([(1, b"b%06d" % i)])
            late = next(iter(client.watch_events(["m"], from_sequence=100, stream_id=stream, timeout=10)))
            assert late.resync and late.events[0].sequence > 100  # told, never a silent gap
            other = next(iter(client.watch_events(["m"], from_sequence=5, stream_id="another-daemon", timeout=10)))
            assert other.resync  # a position in another daemon's stream
    finally:
        daemon.cleanup()


def test_a_watch_of_a_quiet_namespace_hears_its_position_while_others_are_busy(tmp_path):
    daemon = launch.spawn(config(tmp_path))
    try:
        with Client(daemon.target, namespace="busy", timeout=10) as client, \
                Client(daemon.target, timeout=30) as watcher:
            client.map_pool()
            stream = iter(watcher.watch_events(["quiet"], timeout=30))
            first = next(stream)  # where the stream stood
            stop, deadline = threading.Event(), time.monotonic() + 8

            def offload_elsewhere():
                i = 0
                while not stop.is_set() and time.monotonic() < deadline:
                    client.offload([(1, b"b%06d" % i)])
                    i += 1

            busy = threading.Thread(target=offload_elsewhere)
            busy.start()
            try:
                batch = next(stream)  # events never stop for IDLE_S, and none is this watch's
            finally:
                stop.set()
                busy.join()
            assert not batch.events and batch.next_sequence > first.next_sequence
    finally:
        daemon.cleanup()


BAD_WATCHES = [([""], {}), (["a"] * 17, {}), (["bad name!"], {}), (["m"], {"from_sequence": 10**9})]


def test_bad_watch_and_snapshot_requests_are_refused(tmp_path):
    daemon = launch.spawn(config(tmp_path))
    try:
        with Client(daemon.target, timeout=5) as client:
            for namespaces, extra in BAD_WATCHES:
                with pytest.raises(InvalidArgument):
                    next(iter(client.watch_events(namespaces, timeout=5, **extra)))
                if not extra:
                    with pytest.raises(InvalidArgument):
                        list(client.snapshot(namespaces))
            assert client.health() == "SERVING"
    finally:
        daemon.cleanup()


def test_subscribers_are_bounded(tmp_path):
    daemon = launch.spawn(config(tmp_path, max_subscribers=2))
    clients = [Client(daemon.target, timeout=10) for _ in range(3)]
    try:
        open_streams = [iter(c.watch_events(["m"], timeout=30)) for c in clients[:2]]
        for stream in open_streams:
            next(stream)  # (an idle stream answers within seconds: it is open)
        with pytest.raises(ResourceExhausted, match="at most 2"):
            next(iter(clients[2].watch_events(["m"], timeout=10)))
    finally:
        for c in clients:
            c.close()
        daemon.cleanup()


def test_the_cli_prints_events_and_the_metrics_count_them(tmp_path):
    port = free_port()
    daemon = launch.spawn(config(tmp_path, port))
    try:
        with Client(daemon.target, namespace="m") as client:
            client.map_pool()
            client.offload([(b, b"c%02d" % b) for b in BLOCKS[:4]])
        out = subprocess.run([sys.executable, "-m", "service.program", "events", "--target", daemon.target,
                              "--namespace", "m", "--timeout", "1"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:4] == ["SEQ", "TIME", "EVENT", "TIER"]
        assert lines[1].split()[2:7] == ["stored", "host", "rank0", "m", "4"] and b"c01".hex() in lines[1]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvxfer_events_emitted_total 1.0" in metrics and "kvxfer_events_subscribers 0.0" in metrics
    finally:
        daemon.cleanup()


def test_a_registrants_private_group_is_seen_only_by_whoever_holds_one_of_its_pools(tmp_path):
    """WatchEvents and Snapshot filtered by namespace only: any socket user saw which prefixes another
    tenant had cached. Now a registered group's keys are shown to a caller that presents one of its pools
    (the registering client does so itself), or to anyone once it was registered with share_events."""
    import grpc
    import torch

    from kvxfer.core.records import Medium
    from kvxfer.geometry.layout import KVSpec, Layout
    from kvxfer.memory import shm
    from kvxfer.memory.pool import PoolHandle
    from kvxfer.v1 import kvxfer_pb2 as pb
    from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc

    def groups_until_public(c) -> list[str]:
        """The groups of the events a caller is shown, up to the public group's (stored after the private's)."""
        seen = []
        for batch in c.watch_events(["t"], from_sequence=1, timeout=30):
            seen += [e.cache_group for e in batch.events]
            if "public" in seen:
                return seen
        raise AssertionError(seen)

    spec = KVSpec(2, 8, 16, 2, 32, torch.float16)
    daemon = launch.spawn(config(tmp_path))
    owners = {}
    try:
        for group, shared in (("private", False), ("public", True)):
            c = owners[group] = Client(daemon.target, "t", pool_id=group)
            c.register_pool(group, spec, Layout.parse("BLHNC"), PoolHandle(Medium.SHM),
                            fd=shm.create_sealed(group, spec.nbytes), cache_group=group, share_events=shared)
        for group in ("private", "public"):
            assert owners[group].offload([(1, f"{group}-key".encode())]).outcomes == [Outcome.DONE]
        with Client(daemon.target, "t") as stranger:
            assert set(groups_until_public(stranger)) == {"public"}
            snap = lambda c: {(s.cache_group, k) for s in c.snapshot(["t"]) for k in s.keys}  # noqa: E731
            assert snap(stranger) == {("public", b"public-key")}
        assert set(groups_until_public(owners["private"])) == {"private", "public"}
        assert snap(owners["private"]) == {("public", b"public-key"), ("private", b"private-key")}
        # A pool named with a wrong token is refused whole.
        with grpc.insecure_channel(daemon.target) as channel:
            ref = pb.PoolRef(pool_id="private", epoch=owners["private"].pool_info("private").epoch,
                             registration_token=b"x" * 16)
            for call in (lambda: list(pb_grpc.KVTransferStub(channel).Snapshot(
                             pb.SnapshotRequest(namespaces=["t"], pools=[ref]), timeout=10)),
                         lambda: next(iter(pb_grpc.KVTransferStub(channel).WatchEvents(
                             pb.WatchEventsRequest(namespaces=["t"], pools=[ref]), timeout=10)))):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        for c in owners.values():
            c.close()
        daemon.cleanup()


def test_replay_requests_nobody_reads_cost_bounded_memory(tmp_path):
    """The ZeroMQ replay socket kept a full copy of the buffer for every request a client never read:
    1,000 such requests took a daemon from 362 to 747 MiB. Now answers share the buffer's bytes and a
    client that does not read gets no more than one answer queued; the rest are dropped and counted."""
    import zmq

    from tests.e2e.test_abuse import rss_mib

    replay, metrics = f"tcp://127.0.0.1:{free_port()}", free_port()
    daemon = launch.spawn(config(tmp_path, metrics_port=metrics, publish=f"tcp://127.0.0.1:{free_port()}",
                                 replay=replay, replay_batches=64))
    ctx = zmq.Context()
    try:
        with Client(daemon.target, "m", pool_id="rank0") as c:  # a buffer of published batches worth asking for
            for n in range(60):  # long keys: each answer is ~0.5 MiB (it was copied for every request)
                c.offload([(b, b"%03d-%02d-" % (n, b) + b"k" * 200) for b in BLOCKS[:15]])
                time.sleep(0.06)  # (one batch or two each: the publisher lingers 50 ms)
        hoarder = ctx.socket(zmq.DEALER)
        hoarder.setsockopt(zmq.RCVHWM, 1)  # reads nothing: its answers wait in the daemon
        hoarder.connect(replay)
        time.sleep(0.3)
        before = rss_mib(daemon.proc.pid)
        for _ in range(1000):
            hoarder.send_multipart((b"", (0).to_bytes(8, "big")))
        reader = ctx.socket(zmq.DEALER)
        reader.connect(replay)
        reader.send_multipart((b"", (0).to_bytes(8, "big")))
        answer = []
        while True:  # the daemon answers a client that reads, in full, after the hoarder's thousand
            assert reader.poll(30_000), "no replay answer"
            frames = reader.recv_multipart()
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
            answer.append(frames)
        assert len(answer) >= 5

        def publisher(event: str) -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
            return next(float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith(f'kvxfer_events_publisher_total{{event="{event}"}}'))

        deadline = time.monotonic() + 60
        while publisher("replays") + publisher("replay_dropped") < 1001:  # every request handled
            assert time.monotonic() < deadline
            time.sleep(0.1)
        grown = rss_mib(daemon.proc.pid) - before
        dropped = publisher("replay_dropped")
        print(f"RSS grew {grown:.1f} MiB after 1000 unread replay requests; {dropped:.0f} answers dropped")
        assert dropped >= 100 and grown < 64, (grown, dropped)
    finally:
        ctx.destroy(linger=0)
        daemon.cleanup()
