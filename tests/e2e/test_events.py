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
from kvxfer.errors import InvalidArgument, ResourceExhausted
from kvxfer.events.records import EventKind, Reason
from kvxfer.records import TierKind
from service import launch
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.test_metrics import free_port

BLOCKS = range(1, SMALL_POOL["spec"]["num_blocks"])


def config(tmp_path, metrics_port=None, **events):
    return {"log_level": "info", **({"metrics_listen": f"127.0.0.1:{metrics_port}"} if metrics_port else {}),
            "pools": [{**SMALL_POOL, "host_capacity_mib": 0.25}],  # 16 blocks: offloads evict to disk
            "disk": {"path": str(tmp_path / "disk"), "capacity_gib": 0.01}, "events": events}


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
        out = subprocess.run([sys.executable, "-m", "service.cli", "events", "--target", daemon.target,
                              "--namespace", "m", "--timeout", "1"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:4] == ["SEQ", "TIME", "EVENT", "TIER"]
        assert lines[1].split()[2:7] == ["stored", "host", "rank0", "m", "4"] and b"c01".hex() in lines[1]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvxfer_events_emitted_total 1.0" in metrics and "kvxfer_events_subscribers 0.0" in metrics
    finally:
        daemon.cleanup()
