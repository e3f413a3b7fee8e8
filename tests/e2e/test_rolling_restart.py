"""A rolling restart as a cluster does it (issue 46): two replicas, each a daemon with host and disk tiers
and a TP = 2 engine (each rank its own process), and a router that knows them from their KV events alone.
Replica A is stopped with SIGTERM and started again, then killed with SIGKILL and started again, under
traffic. After each start the engine's first restores (both ranks at once, as after an engine restart) hit
what the disk held, no byte is wrong, and the router's view, built from the events (a resync and a
Snapshot where the stream changed), equals what each daemon's Snapshot says."""

import json
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.errors import KvxferError
from kvxfer.core.records import TierKind
from kvxfer.events.event_records import EventKind
from tests.conftest import PYTHON, ROOT, python_env
from tests.e2e.conftest import SMALL_POOL

NS = "tp"  # tp_engine's namespace
TOTAL_HEADS = 64  # canonical blocks of 24 KiB: the 1 MiB host tier of a registered group holds 42
KEYS = 10  # a round's blocks (a rank's pool has 12)


def keys_of(round_: int) -> list[str]:
    return [f"{round_:02x}{i:02x}".encode().hex() * 4 for i in range(KEYS)]


def engine(target: str, mode: str, round_: int) -> list[dict]:
    """Both ranks of the TP = 2 engine at once, each its own process; their results in rank order."""
    procs = [subprocess.Popen([PYTHON, "-m", "tests.e2e.tp_engine", json.dumps(dict(
        target=target, model="llama", group="llama", rank=rank, tp=2, total=TOTAL_HEADS, layout="BLHNC",
        mode=mode, blocks=list(range(1, KEYS + 1)), keys=keys_of(round_), seed=100 + round_, share_events=True))],
        env=python_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


class Router:
    """What a KV-aware router knows of one replica, from its events alone: (cache group, tier, key) of the
    host and disk tiers. It follows WatchEvents from where it stopped, across the daemon's restarts; a new
    stream (or a gap) is a resync: a Snapshot, then the events after it."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.view: set[tuple[str, TierKind, bytes]] = set()
        self.stream_id, self.next, self.resyncs = "", 0, 0
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                with Client(self.target, timeout=30) as client:
                    if not self.stream_id:
                        self._resync(client)
                    for batch in client.watch_events([NS], from_sequence=self.next, stream_id=self.stream_id,
                                                     timeout=3600):
                        with self.lock:
                            if batch.resync or batch.stream_id != self.stream_id:
                                self.stream_id = ""  # (resynced on the next turn: a Snapshot first)
                                break
                            for event in batch.events:
                                self._apply(event)
                            self.next = batch.next_sequence
                        if self.stopped.is_set():
                            return
            except (KvxferError, grpc.RpcError):  # the daemon is restarting: ask again
                self.stopped.wait(0.2)

    def _resync(self, client: Client) -> None:
        view, stream_id, sequence = set(), "", 0
        for snap in client.snapshot([NS]):
            stream_id, sequence = snap.stream_id, snap.sequence
            if snap.tier is not None:
                view |= {(snap.cache_group, snap.tier, bytes(k)) for k in snap.keys}
        with self.lock:
            self.view, self.stream_id, self.next = view, stream_id, sequence + 1
            self.resyncs += 1

    def _apply(self, event) -> None:
        if event.tier not in (TierKind.HOST, TierKind.DISK):
            return
        if event.kind is EventKind.STORED:
            self.view |= {(event.cache_group, event.tier, bytes(k)) for k in event.keys}
        elif event.kind is EventKind.REMOVED:
            self.view -= {(event.cache_group, event.tier, bytes(k)) for k in event.keys}
        else:  # CLEARED: that tier of that group, whole
            self.view = {v for v in self.view if v[:2] != (event.cache_group, event.tier)}

    def agrees(self, timeout: float = 120) -> set:
        """Until the view equals the daemon's Snapshot (events arrive a little after the change); returns it."""
        deadline = time.monotonic() + timeout
        while True:
            truth = snapshot(self.target)
            with self.lock:
                if self.view == truth:
                    return truth
                missing, extra = truth - self.view, self.view - truth
            assert time.monotonic() < deadline, (len(missing), len(extra), sorted(missing)[:3], sorted(extra)[:3])
            time.sleep(0.2)

    def close(self) -> None:
        self.stopped.set()


def snapshot(target: str) -> set[tuple[str, TierKind, bytes]]:
    with Client(target, timeout=30) as client:
        return {(s.cache_group, s.tier, bytes(k)) for s in client.snapshot([NS]) if s.tier for k in s.keys}


def config(home: Path, name: str) -> dict:
    return {"socket": str(home / f"{name}.sock"), "grace_period_s": 30, "log_level": "info", "pools": [SMALL_POOL],
            "registered_host_capacity_mib": 1, "cache_group_retention_s": 3600,
            "disk": {"path": str(home / f"{name}-disk"), "capacity_mib": 51.2}}


def stored_everywhere(results: list[dict]) -> bool:
    return all(r["outcomes"] == ["done"] * KEYS for r in results)


def test_a_rolling_restart_is_warm_from_the_first_request_and_the_router_never_lies():
    home = Path(tempfile.mkdtemp(prefix="kxroll", dir="/tmp"))  # (short: Unix socket paths)
    a = launch.spawn(config(home, "a"))
    b = launch.spawn(config(home, "b"))
    routers = {"a": Router(a.target), "b": Router(b.target)}
    try:
        for round_ in range(6):  # 60 blocks: more than A's host tier holds, the rest demoted to disk
            assert stored_everywhere(engine(a.target, "store", round_))
            if round_ < 2:
                assert stored_everywhere(engine(b.target, "store", round_))
        before = routers["a"].agrees()
        assert {t for _, t, _ in before} == {TierKind.HOST, TierKind.DISK}
        routers["b"].agrees()

        # SIGTERM, as a rolling upgrade does: the host tier is written down, a checkpoint left.
        assert a.stop() == 0
        a.cleanup()
        a = launch.spawn(config(home, "a"))
        for round_ in range(6):  # the first requests: both ranks at once, blocks only the disk holds
            results = engine(a.target, "restore", round_)
            assert all(r["outcomes"] == ["done"] * KEYS and all(r["matches"]) for r in results), (round_, results)
        routers["a"].agrees()
        routers["b"].agrees()

        # More traffic, then SIGKILL: what the disk held (the journal says) comes back, nothing else.
        for round_ in range(6, 9):
            assert stored_everywhere(engine(a.target, "store", round_))
        held = routers["a"].agrees()
        on_disk = {k for _, tier, k in held if tier is TierKind.DISK}
        assert on_disk
        a.stop(signal.SIGKILL)
        a.cleanup()
        a = launch.spawn(config(home, "a"))
        hits = 0
        for round_ in range(9):
            keys = [bytes.fromhex(k) for k in keys_of(round_)]
            for rank in engine(a.target, "restore", round_):
                for key, outcome, match in zip(keys, rank["outcomes"], rank["matches"]):
                    assert outcome in ("done", "not_found"), (round_, rank)
                    assert outcome != "done" or match  # never a wrong byte
                    assert key not in on_disk or outcome == "done", (round_, key)  # the disk's blocks hit
                    hits += outcome == "done"
        assert hits >= 2 * len(on_disk)
        routers["a"].agrees()
        routers["b"].agrees()
        assert routers["a"].resyncs >= 3 and routers["b"].resyncs == 1  # A's new streams; B's never changed
    finally:
        for router in routers.values():
            router.close()
        a.cleanup()
        b.cleanup()
        subprocess.run(["rm", "-rf", str(home)], check=False)
