"""``kvxfer bench bookkeeping``: the per-block cost of everything but the copy, alone.

A request of ``--blocks`` blocks (10,000 by default) goes through PoolManager as
the daemon runs it (a TransferBatch built and validated from columns, the index
prepared and completed, outcomes tallied) with a copy engine that moves nothing,
so that what is timed is bookkeeping only. Scenarios: an offload of new keys into
a tier with room, a restore of the keys just stored, and an offload of new keys
into a full tier (every block evicts one: the steady state of a busy cache).
Baseline, in the same process on the same keys: inserting them into a Python
dict and looking them up again (what any per-key index in CPython pays at least).
Median of ``--reps`` repetitions, in microseconds per block.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from kvxfer.bench.common import Progress, save
from kvxfer.core.text_table import format_table
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.transfer.copy_engine import CompletedHandle, CopyBatch, CopyEngine, CopyHandle

NS = "bench"
TARGET_US = 0.2


class NoCopyEngine(CopyEngine):
    """Moves nothing; hands back one (constant) checksum per block, as the CPU engine hands back real ones."""

    descriptors_per_block = 1
    hashes_copies = True

    def submit(self, batch: CopyBatch) -> CopyHandle:
        return CompletedHandle(checksums=[0x9E3779B97F4A7C15] * len(batch.blocks))

    def pool_checksums(self, blocks: list[int]) -> list[int]:
        return [0x9E3779B97F4A7C15] * len(blocks)


def _keys(tag: str, n: int) -> list[bytes]:
    return [b"%s-%08d" % (tag.encode(), i) for i in range(n)]  # fresh objects, as a request's are


def measure(args: argparse.Namespace, shm_dir: str, progress: Progress) -> list[dict]:
    n, reps = args.blocks, args.reps
    spec = KVSpec(1, n + 1, 1, 1, 8, torch.float16)  # tiny blocks: nothing here is about bytes
    blocks = list(range(1, n + 1))
    times: dict[str, list[float]] = {"offload, new keys, room": [], "restore, keys just stored": [],
                                     "offload, new keys, tier full (evicts as many)": [],
                                     "baseline: dict insert + lookup of the same keys": []}
    with Pool.create("bookkeeping", spec, Layout.parse("BLHNC"), shm_dir=shm_dir) as pool:
        roomy = PoolManager(pool, n * (reps + 1), engine=NoCopyEngine())
        full = PoolManager(pool, n, engine=NoCopyEngine())
        full.run(TransferBatch.build(TransferKind.OFFLOAD, NS, blocks, _keys("fill", n), n + 1))
        for rep in range(reps + 1):  # the first repetition warms up
            keys = _keys(f"r{rep}", n)
            run = {}
            start = time.perf_counter()
            result = roomy.run(TransferBatch.build(TransferKind.OFFLOAD, NS, blocks, keys, n + 1))
            run["offload, new keys, room"] = time.perf_counter() - start
            keys = list(map(bytes, keys))  # a new request's own key objects
            start = time.perf_counter()
            result = roomy.run(TransferBatch.build(TransferKind.RESTORE, NS, blocks, keys, n + 1))
            run["restore, keys just stored"] = time.perf_counter() - start
            assert result.outcomes.count(result.outcomes[0]) == n and result.outcomes[0].value == "done"
            keys = _keys(f"f{rep}", n)
            start = time.perf_counter()
            full.run(TransferBatch.build(TransferKind.OFFLOAD, NS, blocks, keys, n + 1))
            run["offload, new keys, tier full (evicts as many)"] = time.perf_counter() - start
            keys = _keys(f"d{rep}", n)
            start = time.perf_counter()
            table = dict(zip(keys, blocks))
            list(map(table.get, keys))
            run["baseline: dict insert + lookup of the same keys"] = time.perf_counter() - start
            if rep:
                for name, seconds in run.items():
                    times[name].append(seconds)
            progress.step(f"repetition {rep}: " + ", ".join(f"{k.split(',')[0]} {v / n * 1e6:.3f} us/block"
                                                         for k, v in run.items()))
        assert full.stats().tiers[0].pinned_blocks == 0 and roomy.stats().tiers[0].pinned_blocks == 0
    return [{"scenario": name, "blocks_per_request": n, "us_per_block": statistics.median(t) / n * 1e6}
            for name, t in times.items()]


def run(args: argparse.Namespace) -> int:
    progress = Progress(args.reps + 1)
    shm_dir = tempfile.mkdtemp(prefix="kvxfer-bench-", dir="/dev/shm")
    try:
        results = measure(args, shm_dir, progress)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    print(format_table(["scenario", "blocks per request", "us per block", f"target <= {TARGET_US}"],
                       [[r["scenario"], r["blocks_per_request"], f"{r['us_per_block']:.3f}",
                         "" if r["scenario"].startswith("baseline") else
                         ("met" if r["us_per_block"] <= TARGET_US else "not met")] for r in results]))
    save(args, results)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=10_000, help="blocks per request")
    p.add_argument("--reps", type=int, default=9, help="repetitions; the median is reported")
    p.add_argument("--json", help="also write the results as JSON here")
