"""``kvxfer bench hints``: what a PREFETCH buys a request that waits, and what a hint storm costs others.

A real daemon with one CPU pool (192 KiB blocks), a host tier of 2 x ``--blocks`` blocks and a
disk tier in ``--dir``. ``--blocks`` blocks are offloaded, then twice as many, so the first go
down to disk. Then, ``--batch`` blocks at a time, the three subjects in turn each repetition:

- **disk**: the disk tier's files dropped from the page cache (``posix_fadvise(DONTNEED)``), then
  a Restore of blocks only the disk holds: what a load pays without a prefetch;
- **prefetched**: the same drop, a PREFETCH of other such blocks, a wait until they are in host
  memory (a request that waits in the queue longer than the fetch), then their Restore;
- **host**: a Restore of blocks the host tier holds: a host-tier hit, the baseline.

Reported: each one's median, the prefetched load over the host hit (target at most 1.2x), the
share of the prefetched blocks that were in host memory when their Restore came (target at least
0.9), and how long the prefetches took (the wait they need). Then the **storm**: one-block
Restores from host memory, in turn: alone; while ``--storm-clients`` processes spin (the cores a
storm's clients take, nothing sent: the storm's baseline); and while as many processes send RETAIN
and RELEASE hints of ``--storm-keys`` keys as fast as the daemon takes them. Their p50 and p99, and
the daemon's CPU seconds (user and system, from /proc) over each phase's wall time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

from kvxfer.bench import launch
from kvxfer.bench.common import Progress, save
from kvxfer.client import Client
from kvxfer.core.defaults import DEFAULT_POOL
from kvxfer.core.errors import ResourceExhausted
from kvxfer.core.records import HintAction, TierKind
from kvxfer.core.text_table import format_table

BLOCK_KIB = 192  # the embedded pool's block


def drop_page_cache(directory: str) -> None:
    """Drop the disk tier's files from the page cache, as if read long ago."""
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue  # (a file the tier replaced meanwhile)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cpu_seconds(pid: int) -> float:
    """User and system seconds of a process so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _restore(client: Client, keys: list[bytes]) -> float:
    start = time.perf_counter()
    client.restore([(k, 1 + j) for j, k in enumerate(keys)], timeout=120)
    return time.perf_counter() - start


def _in_host(client: Client, keys: list[bytes]) -> int:
    return sum(t is TierKind.HOST for t in client.lookup(keys).tiers)


def drained(client: Client, pool_id: str = "", tier: TierKind = TierKind.DISK, timeout: float = 300) -> None:
    """Until a lower tier (of ``pool_id``'s group; "": the daemon's only pool) holds no demotion in flight."""
    deadline = time.monotonic() + timeout
    while next(t for t in client.stats(pool_id)[0].tiers if t.tier is tier).pinned_blocks:
        if time.monotonic() > deadline:
            raise SystemExit(f"the {tier.value} tier did not take its demotions within {timeout:.0f} s")
        time.sleep(0.02)


def prefetch_phase(client: Client, disk: str, args: argparse.Namespace, progress: Progress) -> dict:
    cold = [b"a%06d" % i for i in range(args.blocks)]  # down on disk once the second set is stored
    hot = [b"b%06d" % i for i in range(2 * args.blocks)]  # fills the host tier: its newest are the host hits
    for keys in (cold, hot):
        for first in range(0, len(keys), 64):
            chunk = keys[first:first + 64]
            client.offload([(1 + j, k) for j, k in enumerate(chunk)], timeout=120)
            drained(client)  # (paced by the disk: a demotion the full queue dropped would be a block lost)
    tiers = client.lookup(cold).tiers
    cold = [k for k, t in zip(cold, tiers) if t is TierKind.DISK]
    progress.step(f"{len(cold)} blocks on disk, {2 * args.blocks} in host memory")
    times: dict[str, list[float]] = {"disk": [], "prefetched": [], "host": []}
    waits, served = [], []
    batches = [cold[i:i + args.batch] for i in range(0, len(cold) - args.batch + 1, args.batch)]
    for rep in range(len(batches) // 2):
        on_disk, wanted = batches[2 * rep], batches[2 * rep + 1]
        # Host hits read as long ago as the prefetched blocks were written (none of it still in the CPU's caches);
        # the promotions evict the oldest of the 2 x blocks, never these newest.
        host = hot[len(hot) - (rep + 1) * args.batch:len(hot) - rep * args.batch]
        drop_page_cache(disk)
        times["disk"].append(_restore(client, on_disk))
        drop_page_cache(disk)
        start = time.perf_counter()
        client.hint(HintAction.PREFETCH, wanted, request_id=f"bench-{rep}")
        while _in_host(client, wanted) < len(wanted) and time.perf_counter() - start < 60:
            time.sleep(0.001)
        waits.append(time.perf_counter() - start)
        served.append(_in_host(client, wanted) / len(wanted))
        times["prefetched"].append(_restore(client, wanted))
        times["host"].append(_restore(client, host))
        progress.step(f"rep {rep + 1}: disk {times['disk'][-1] * 1e3:.1f} ms, prefetched "
                      f"{times['prefetched'][-1] * 1e3:.1f} ms (after {waits[-1] * 1e3:.0f} ms), "
                      f"host {times['host'][-1] * 1e3:.1f} ms")
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"batch": args.batch, "median_s": med, "times_s": times, "prefetch_wait_s": waits,
            "served_from_host": served, "prefetched_over_host": med["prefetched"] / med["host"],
            "disk_over_host": med["disk"] / med["host"]}


def _flood(target: str, keys: list[bytes], stop, sent) -> None:
    """A client process sending RETAIN and RELEASE of ``keys`` as fast as the daemon takes them, until ``stop``;
    without keys, one that only spins (the same cores taken, nothing sent)."""
    with Client(target, "default", timeout=60) as client:
        client.pool_info()
        while not keys and not stop.is_set():
            with sent.get_lock():
                sent.value += 1
            sum(range(100_000))
        while keys and not stop.is_set():
            try:
                client.hint(HintAction.RETAIN, keys, ttl_s=600)
                client.hint(HintAction.RELEASE, keys)
                with sent.get_lock():
                    sent.value += 2
            except ResourceExhausted:
                pass  # more in flight than the daemon takes: refused, as it should be


def storm_phase(client: Client, daemon: launch.DaemonProcess, args: argparse.Namespace, progress: Progress) -> dict:
    key = [b"b%06d" % (2 * args.blocks - 1)]
    storm = [b"s%06d" % i for i in range(args.storm_keys)] + [b"b%06d" % i for i in range(args.blocks)]
    phases = {"alone": [], "busy": [], "storm": storm}  # busy: as many processes spinning, sending nothing
    latencies: dict[str, list[float]] = {phase: [] for phase in phases}
    cpu, wall = dict.fromkeys(phases, 0.0), dict.fromkeys(phases, 0.0)
    ctx = multiprocessing.get_context("spawn")
    stop, sent, spun = ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0)
    for rep in range(args.reps):
        for phase, keys in phases.items():
            stop.clear()
            floods = [ctx.Process(target=_flood, args=(daemon.target, keys, stop, spun if phase == "busy" else sent))
                      for _ in range(args.storm_clients if phase != "alone" else 0)]
            for f in floods:
                f.start()
            counter = spun if phase == "busy" else sent
            began = counter.value
            while floods and counter.value < began + 2 * len(floods):  # (their interpreters started, and working)
                time.sleep(0.05)
            before, start = cpu_seconds(daemon.proc.pid), time.perf_counter()
            done = 0
            while done < args.restores or time.perf_counter() - start < args.phase_s:
                latencies[phase].append(_restore(client, key))
                done += 1
            cpu[phase] += cpu_seconds(daemon.proc.pid) - before
            wall[phase] += time.perf_counter() - start
            stop.set()
            for f in floods:
                f.join(60)
        progress.step(f"storm rep {rep + 1}: {sent.value} hints sent so far")

    def pct(values: list[float], q: float) -> float:
        return sorted(values)[min(len(values) - 1, int(q * len(values)))]

    return {"hints_sent": sent.value, "keys_a_hint": len(storm),
            **{f"{phase}_p50_ms": pct(v, 0.5) * 1e3 for phase, v in latencies.items()},
            **{f"{phase}_p99_ms": pct(v, 0.99) * 1e3 for phase, v in latencies.items()},
            "daemon_cpu_s": cpu, "wall_s": wall}


def run(args: argparse.Namespace) -> int:
    progress = Progress(3 + args.blocks // args.batch // 2 + args.reps)
    with tempfile.TemporaryDirectory(dir=args.dir) as disk:
        pool = {**DEFAULT_POOL, "device": "cpu", "host_capacity_mib": 2 * args.blocks * BLOCK_KIB / 1024}
        disk_mib = 3 * args.blocks * BLOCK_KIB // 1024
        daemon = launch.spawn({"pools": [pool], "disk": {"path": disk, "capacity_mib": disk_mib},
                               "log_level": "warning", "hints": {"share": 1.0}})
        try:  # nothing between spawn and this try: the daemon must never outlive the benchmark
            daemon.wait_warm()
            progress.step(f"daemon serving on {daemon.target}")
            with Client(daemon.target, "default", timeout=60) as client:
                client.map_pool().storage.random_(0, 255)
                prefetch = prefetch_phase(client, disk, args, progress)
                storm = storm_phase(client, daemon, args, progress)
        finally:
            daemon.stop()
            daemon.cleanup()
    med = prefetch["median_s"]
    print(format_table(["batch", "disk (no prefetch)", "prefetched", "host hit", "prefetched / host", "disk / host",
                        "served from host", "prefetch took"],
                       [[f"{args.batch} x {BLOCK_KIB} KiB", f"{med['disk'] * 1e3:.2f} ms",
                         f"{med['prefetched'] * 1e3:.2f} ms",
                         f"{med['host'] * 1e3:.2f} ms", f"{prefetch['prefetched_over_host']:.2f}x",
                         f"{prefetch['disk_over_host']:.2f}x", f"{min(prefetch['served_from_host']):.0%} at least",
                         f"{statistics.median(prefetch['prefetch_wait_s']) * 1e3:.0f} ms median"]],
                       {"prefetched": "a Restore after a PREFETCH of the same blocks had brought them up (target: at "
                                      "most 1.2x the host hit)",
                        "served from host": "blocks in host memory when their Restore came (target: at least 90%)"}))
    c, w = storm["daemon_cpu_s"], storm["wall_s"]
    print(format_table(["one-block Restore", "p50", "p99", "daemon CPU / wall"],
                       [[phase, f"{storm[f'{phase}_p50_ms']:.2f} ms", f"{storm[f'{phase}_p99_ms']:.2f} ms",
                         f"{c[phase] / w[phase]:.2f}"] for phase in ("alone", "busy", "storm")],
                       {"busy": f"{args.storm_clients} client processes spinning, sending nothing: the cores "
                                "the storm's clients take, without their hints (the storm's baseline)",
                        "storm": f"{args.storm_clients} client processes sending RETAIN and RELEASE of "
                                 f"{storm['keys_a_hint']} keys "
                                 f"({storm['hints_sent']} hints in all)"}))
    save(args, {"blocks": args.blocks, "batch": args.batch, "prefetch": prefetch, "storm": storm})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=512,
                   help="blocks of 192 KiB on disk (the host tier holds twice as many)")
    p.add_argument("--batch", type=int, default=32, help="blocks a request loads")
    p.add_argument("--dir", default="/tmp", help="where the disk tier goes (a directory on the device to measure)")
    p.add_argument("--reps", type=int, default=4, help="storm: repetitions of the two phases, in turn")
    p.add_argument("--restores", type=int, default=100, help="storm: one-block Restores a phase, at least")
    p.add_argument("--phase-s", type=float, default=2.0, help="storm: seconds a phase lasts, at least")
    p.add_argument("--storm-clients", type=int, default=4, help="storm: client processes sending hints")
    p.add_argument("--storm-keys", type=int, default=4096, help="storm: keys a hint names")
    p.add_argument("--json", help="write the results here")
