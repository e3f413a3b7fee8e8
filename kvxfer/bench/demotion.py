"""``kvxfer bench demotion``: how many blocks the host tier evicts reach the disk under load.

A real daemon with one CPU pool (192 KiB blocks), a small host tier and a disk tier in
``--dir``; ``--clients`` client processes offload batches of fresh keys as fast as they
can for ``--seconds``, so the host tier evicts at the rate they offload and every
eviction is a demotion. Reported from the daemon's own counters: demotions written,
dropped (the bounded queue was full: the disk was behind), and their rates. Baseline in
the same run: the device's plain rate for the same files (write + fdatasync per file,
one thread) in the same directory, before and after the load, averaged.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time

from kvxfer.bench import launch
from kvxfer.bench.common import Progress
from kvxfer.bench.daemon import block_bytes
from kvxfer.client import Client
from kvxfer.core.defaults import DEFAULT_POOL
from kvxfer.core.records import Outcome, TierKind
from kvxfer.core.text_table import format_table

MIB = 1 << 20


def _client(target: str, index: int, seconds: float, batch: int, rate: float, out: multiprocessing.Queue) -> None:
    """Offload batches of fresh keys (``rate`` blocks a second, 0: as fast as it can) until
    ``seconds`` pass; report how many blocks were stored."""
    import torch

    with Client(target, f"c{index}", timeout=60) as client:
        pool = client.map_pool()
        pool.storage.view(torch.int64).random_()
        blocks = list(range(1, 2 * batch, 2))
        stored, n, began = 0, 0, time.monotonic()
        while time.monotonic() < began + seconds:
            if rate:
                time.sleep(max(0.0, began + n / rate - time.monotonic()))
            keys = [b"%d-%d" % (index, n + i) for i in range(batch)]
            result = client.offload(list(zip(blocks, keys)))
            stored += sum(o is Outcome.DONE for o in result.outcomes)
            n += batch
    out.put(stored)


def plain_rate(directory: str, nbytes: int, files: int = 256) -> float:
    """Blocks a second one thread makes durable as plain files (write, fdatasync, close)."""
    data = os.urandom(nbytes)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        start = time.perf_counter()
        for i in range(files):
            fd = os.open(os.path.join(scratch, f"{i}"), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
                os.fdatasync(fd)
            finally:
                os.close(fd)
        dirfd = os.open(scratch, os.O_RDONLY)
        os.fsync(dirfd)
        os.close(dirfd)
        return files / (time.perf_counter() - start)


def _disk_events(target: str) -> dict:
    with Client(target) as client:
        return next(t for t in client.stats()[0].tiers if t.tier is TierKind.DISK).events


def run(args: argparse.Namespace) -> int:
    spec = dict(DEFAULT_POOL["spec"])
    block = block_bytes(spec)
    progress = Progress(4)
    baseline = plain_rate(args.dir, block)
    progress.step(f"plain: {baseline:.0f} blocks/s durable, one file each")
    with tempfile.TemporaryDirectory(dir=args.dir) as disk:
        daemon = launch.spawn({"pools": [{**DEFAULT_POOL, "device": "cpu", "host_capacity_mib": args.host_mib}],
                               "disk": {"path": disk, "capacity_mib": args.disk_gib * 1024}, "log_level": "warning"})
        try:  # nothing between spawn and this try: the daemon must never outlive the benchmark
            progress.step(f"daemon serving on {daemon.target}")
            ctx = multiprocessing.get_context("spawn")
            out = ctx.Queue()
            workers = [ctx.Process(target=_client, args=(daemon.target, i, args.seconds, args.batch,
                                                                   args.rate / args.clients, out))
                       for i in range(args.clients)]
            start = time.monotonic()
            for w in workers:
                w.start()
            stored = sum(out.get(timeout=args.seconds + 120) for _ in workers)
            for w in workers:
                w.join(30)
            offered_s = time.monotonic() - start
            progress.step(f"{args.clients} clients stored {stored} blocks in {offered_s:.1f} s")
            deadline = time.monotonic() + 120  # let the queue drain: what is queued is written, not lost
            while True:
                events = _disk_events(daemon.target)
                if time.monotonic() > deadline or (
                        events.get("demoted", 0) + events.get("demotions_dropped", 0) + events.get("write_errors", 0)
                        >= stored - args.host_mib * MIB // block - 64):
                    break
                time.sleep(0.2)
            progress.step("queue drained")
        finally:
            daemon.stop()
            daemon.cleanup()
    baseline = (baseline + plain_rate(args.dir, block)) / 2  # the device drifts: before and after, averaged
    demoted, dropped = events.get("demoted", 0), events.get("demotions_dropped", 0)
    result = {"clients": args.clients, "rate": args.rate, "seconds": round(offered_s, 1), "block_bytes": block, "stored": stored,
              "offered_per_s": round(stored / args.seconds), "demoted": demoted, "dropped": dropped,
              "dropped_fraction": round(dropped / max(demoted + dropped, 1), 3),
              "write_errors": events.get("write_errors", 0), "plain_blocks_per_s": round(baseline)}
    print(format_table(["clients", "offloaded blocks/s (asked)", "demoted", "dropped (queue full)", "dropped share",
                        "plain durable blocks/s (1 thread)"],
                       [[args.clients, f"{result['offered_per_s']} ({args.rate or 'flat out'})", demoted, dropped, result["dropped_fraction"],
                         result["plain_blocks_per_s"]]]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=4, help="client processes offloading at once")
    p.add_argument("--seconds", type=float, default=10.0, help="how long they offload")
    p.add_argument("--batch", type=int, default=16, help="blocks per Offload")
    p.add_argument("--rate", type=float, default=0.0, help="blocks a second offloaded by all clients (0: flat out)")
    p.add_argument("--host-mib", type=int, default=64, help="the host tier (small: every offload evicts)")
    p.add_argument("--disk-gib", type=float, default=8.0, help="the disk tier's capacity")
    p.add_argument("--dir", default="/tmp", help="a directory on the device to measure")
    p.add_argument("--json", help="also write the results as JSON here")
