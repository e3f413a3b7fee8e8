"""``kvxfer bench disk``: the disk tier's demotion and promotion beside plain file I/O of the same bytes.

Demotion: ``--blocks`` blocks made durable by the tier (a header and the block per file,
written to a temporary name, fsynced, renamed, the directory fsynced once per batch of
64, then published), beside a plain write of the same bytes to as many files with the
same durability (write, fsync each file, rename, fsync the directory per 64).
Promotion: the same blocks brought up into host slots by a restore (read, header
checked, XXH3 verified) with a cold page cache (``posix_fadvise(DONTNEED)`` on every
file first), beside a plain read of the same files, cold too. Index: how long a
restarted tier takes to index ``--index-blocks`` files: from the checkpoint of a clean shutdown, from
the base and journal a crash left, and by reading every header (neither there).
Interleaved repetitions in one process; ``--dir`` must be on the device to measure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

from kvxfer.bench.common import FASTER, GB, Progress, add_block_arguments, human_bytes
from kvxfer.core.records import TierKind
from kvxfer.core.text_table import format_table
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.disk.files import BASE, HEADER_BYTES, JOURNAL
from kvxfer.tiers.disk.settings import DiskSettings
from kvxfer.tiers.record import encode_header
from kvxfer.tiers.registry import lower_tiers

BATCH = 64


def _cold(directory: Path) -> None:
    """Drop the files' pages from the page cache (what a read after a restart meets)."""
    for path in directory.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _plain_write(directory: Path, data: torch.Tensor) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rows = data.numpy()
    for start in range(0, len(rows), BATCH):
        for i in range(start, min(start + BATCH, len(rows))):
            tmp, final = directory / f"{i}.tmp", directory / f"{i}.kvb"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, rows[i])
            os.fsync(fd)
            os.close(fd)
            os.rename(tmp, final)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)


def _plain_read(directory: Path, out: torch.Tensor) -> None:
    rows = out.numpy()
    for i in range(len(rows)):
        fd = os.open(directory / f"{i}.kvb", os.O_RDONLY)
        os.preadv(fd, [rows[i]], 0)
        os.close(fd)


def _tier_round(root: Path, pool: Pool, n: int, rep: int) -> tuple[float, float]:
    """(demotion s, promotion s) of n blocks through a fresh group's disk tier."""
    shutil.rmtree(root, ignore_errors=True)
    settings = DiskSettings(str(root), (n + 8) * (HEADER_BYTES + pool.layout.block_bytes) * 2, queue_blocks=n,
                            workers=8)
    group = CacheGroup(f"bench{rep}", pool.layout, n, lower=lower_tiers(disk=settings))
    manager = PoolManager(pool, group)
    keys = [b"k%d" % i for i in range(n)]
    for start in range(0, n, 256):
        manager.offload("ns", [(1 + i % (pool.layout.spec.num_blocks - 1), keys[i])
                               for i in range(start, min(start + 256, n))])
    start = time.perf_counter()
    written = group.demote_all(600)
    demote = time.perf_counter() - start
    assert written == n, (written, n)
    group.index.delete("ns", keys)  # only the disk holds them now
    _cold(root)
    start = time.perf_counter()
    for first in range(0, n, 256):
        chunk = keys[first:first + 256]
        result = manager.restore("ns", [(k, 1 + j) for j, k in enumerate(chunk)])
        assert all(o.value == "done" for o in result.outcomes), result.outcomes[:4]
        group.index.delete("ns", chunk)  # make room in the host tier for the next chunk
    promote = time.perf_counter() - start
    group.close(10)
    return demote, promote


def index_time(root: Path, pool: Pool, n: int) -> tuple[float, float, float, int]:
    """Seconds a restarted tier takes to index n files by scanning them (a crash that left no journal),
    from the checkpoint a clean shutdown wrote and from the base and journal a crash left, each with
    the new base written; and the index's bytes per block."""
    settings = DiskSettings(str(root), n * (HEADER_BYTES + pool.layout.block_bytes), queue_blocks=1, workers=1)
    directory = root / "index"
    block = b"\0" * pool.layout.block_bytes
    group = CacheGroup("index", pool.layout, 1, lower=lower_tiers(disk=settings))
    tier = group.tier(TierKind.DISK).tier
    for slot in range(n):  # files as the tier writes them (no fsync: only the indexing is timed)
        path = tier.path(slot)
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the tier adopts only its own mode
        with os.fdopen(fd, "wb") as f:
            f.write(encode_header(tier.fingerprint, "ns", b"key%d" % slot, 0, len(block), HEADER_BYTES) + block)
    group.close(5)
    (directory / ".checkpoint").unlink()  # it knew none of them: as after a crash, the files are scanned
    tracemalloc.start()
    group = CacheGroup("index", pool.layout, 1, lower=lower_tiers(disk=settings))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    scan = group.tier(TierKind.DISK).index_seconds
    assert group.tier(TierKind.DISK).stats().ready_blocks == n
    crashed = root / "crashed"  # the base and journal as a crash now would leave them
    crashed.mkdir()
    for name in (BASE, JOURNAL):
        shutil.copy2(directory / name, crashed / name)
    group.close(5)  # a clean shutdown: the checkpoint
    group = CacheGroup("index", pool.layout, 1, lower=lower_tiers(disk=settings))
    checkpoint = group.tier(TierKind.DISK).index_seconds
    stats = group.tier(TierKind.DISK).stats()
    assert stats.ready_blocks == n and stats.events["found_at_start"] == n
    group.close(5)
    (directory / ".checkpoint").unlink()
    for name in (BASE, JOURNAL):
        os.replace(crashed / name, directory / name)
    group = CacheGroup("index", pool.layout, 1, lower=lower_tiers(disk=settings))
    journal = group.tier(TierKind.DISK).index_seconds
    stats = group.tier(TierKind.DISK).stats()
    assert stats.ready_blocks == n and stats.events["found_at_start"] == n
    group.close(5)
    shutil.rmtree(directory, ignore_errors=True)
    return scan, checkpoint, journal, peak // n


def run(args: argparse.Namespace) -> int:
    spec = KVSpec(args.layers, args.blocks + 1, 16, args.heads, args.head_size, torch.bfloat16)
    pool = Pool.create("bench", spec, Layout.parse("BLHNC"))
    storage = pool.storage
    storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8))
    n, block = args.blocks, pool.layout.block_bytes
    root = Path(tempfile.mkdtemp(prefix="kvxfer-bench-disk-", dir=args.dir))
    data = storage[:n * block].view(n, block).clone()
    out = torch.empty_like(data)
    progress = Progress(args.reps + (1 if args.index_blocks else 0))
    rows = {"demote": [], "plain_write": [], "promote": [], "plain_read": []}
    try:
        for rep in range(args.reps):
            demote, promote = _tier_round(root / "tier", pool, n, rep)
            plain = root / "plain"
            shutil.rmtree(plain, ignore_errors=True)
            start = time.perf_counter()
            _plain_write(plain, data)
            rows["plain_write"].append(time.perf_counter() - start)
            _cold(plain)
            start = time.perf_counter()
            _plain_read(plain, out)
            rows["plain_read"].append(time.perf_counter() - start)
            rows["demote"].append(demote)
            rows["promote"].append(promote)
            progress.step(f"rep {rep}: demote {n * block / demote / GB:.2f} GB/s, "
                          f"plain write {n * block / rows['plain_write'][-1] / GB:.2f} GB/s")
        med = {k: statistics.median(v) for k, v in rows.items()}
        nbytes = n * block
        print(f"{n} blocks of {human_bytes(block)} in {args.dir}; median of {args.reps}")
        print(format_table(["path", "GB/s", "tier / plain"], [
            ["demotion (tier: durable, published)", nbytes / med["demote"] / GB, med["plain_write"] / med["demote"]],
            ["plain write, same durability", nbytes / med["plain_write"] / GB, 1.0],
            ["promotion (tier: read, verified, in host)", nbytes / med["promote"] / GB,
             med["plain_read"] / med["promote"]],
            ["plain read, cold cache", nbytes / med["plain_read"] / GB, 1.0]],
            {"tier / plain": FASTER + " (the plain file I/O below it)"}))
        if args.index_blocks:
            scan, checkpoint, journal, per_block = index_time(
                root, Pool.create("ix", KVSpec(1, 2, 16, 1, 8, torch.bfloat16), Layout.parse("BLHNC")),
                args.index_blocks)
            progress.step("index")
            print(f"index loaded at start, {args.index_blocks} blocks (the new journal's base written "
                  f"included): {checkpoint:.2f} s from the checkpoint (after a clean shutdown), {journal:.2f} s "
                  f"from the base and journal (after a crash), {scan:.2f} s scanning the files (neither there); "
                  f"{per_block} bytes of index memory per block (tracemalloc peak)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_block_arguments(p)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the device to measure")
    p.add_argument("--index-blocks", type=int, default=100_000, help="0: skip the index rebuild timing")
